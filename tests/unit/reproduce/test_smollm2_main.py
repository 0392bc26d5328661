"""`sao bench main --model smollm2`: the decisions the issue-27 harness makes without running anything:
which result files count as done, equal budgets (the harness end to end: tests/e2e/test_smollm2_main_quick.py).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks.reproduce import run_results, smollm2_main
from benchmarks.reproduce.runner import Run, RunResult
from benchmarks.reproduce.starts import TOY_QUICK_CONFIG
from tests.paths import REPO

ROWS = smollm2_main.TASKS["arith"].rows


def _fake_start(d: Path, digest: str = "d" * 64) -> smollm2_main.SftStart:
    return smollm2_main.SftStart("toy_sft", TOY_QUICK_CONFIG, d, (), 0.0, digest=digest, pretrained=d / "critic",
                                 pretrain_rollouts=8)


def test_result_key_changes_with_config_algorithm_version_and_sft_weights_not_with_the_start_path(tmp_path,
                                                                                                  monkeypatch):
    from megatron_sao.trainer import step

    b = smollm2_main.QUICK
    start = _fake_start(tmp_path / "a" / "toy_sft-1")
    run = smollm2_main.plan(start, b, [1], ROWS)[0]
    key = run_results.result_key(run, start.dir, start.digest)
    path = run_results.result_path(tmp_path, run, key)
    run_results.write(path, {"key": key, "algorithm_version": step.ALGORITHM_VERSION})
    assert run_results.load(path, key) is not None

    # The same SFT weights built elsewhere (another checkout): the same result.
    moved = _fake_start(tmp_path / "b" / "toy_sft-1")
    assert run_results.result_key(smollm2_main.plan(moved, b, [1], ROWS)[0], moved.dir, moved.digest) == key
    # Other SFT weights, another override, another seed: another result file.
    assert run_results.result_key(run, start.dir, "e" * 64) != key
    changed = Run(run.label, run.seed, run.config, (*run.overrides, "algorithm.critic_steps=1"))
    assert run_results.result_key(changed, start.dir, start.digest) != key
    assert run_results.result_key(smollm2_main.plan(start, b, [2], ROWS)[0], start.dir, start.digest) != key
    # A code change that makes the same config train differently: the old file is not this run's result.
    monkeypatch.setattr(step, "ALGORITHM_VERSION", step.ALGORITHM_VERSION + 1)
    new_key = run_results.result_key(run, start.dir, start.digest)
    assert new_key != key and not run_results.result_path(tmp_path, run, new_key).exists()
    assert run_results.stale(tmp_path, {run: run_results.result_path(tmp_path, run, new_key)}) == [path.name]
    other_seed = smollm2_main.plan(start, b, [2], ROWS)[0]  # not a run of this invocation: not its stale file
    assert run_results.stale(tmp_path, {other_seed: run_results.result_path(tmp_path, other_seed, new_key)}) == []
    with pytest.raises(ValueError, match="delete the file"):  # and the old file is never read as the new one
        run_results.load(path, key)


@pytest.mark.parametrize("budget,task", [(smollm2_main.QUICK, "arith"), (smollm2_main.FULL, "arith"),
                                         (smollm2_main.FULL, "chain")])
def test_budget_a_gives_every_method_the_same_actor_steps_and_budget_b_the_same_trajectories(tmp_path, budget, task):
    """A (the paper's): every method `actor_steps` actor steps of `batch`, SAO's warm-up and value pretraining
    not counted. B: every rollout counted: the methods without a critic train as many trajectories as SAO
    spends in value pretraining, warm-up and the same actor steps; one run of theirs is read at both. L (chains'
    `sao_long`): every method B's actor steps, SAO's warm-up and value pretraining not counted."""
    config = TOY_QUICK_CONFIG if budget is smollm2_main.QUICK else smollm2_main.TASKS[task].config
    vp = 512 if budget is smollm2_main.FULL else 8
    start = smollm2_main.SftStart("s", config, tmp_path, (), 0.0, digest="d", pretrained=tmp_path / "critic",
                                  pretrain_rollouts=vp)
    rows = smollm2_main.TASKS[task].rows
    runs = smollm2_main.plan(start, budget, smollm2_main.DEFAULT_SEEDS, rows)
    assert len(runs) == len(rows) * 3 and [r.label for r in runs[:len(rows)]] == list(rows)  # seed-major
    by_label = {r.label: r for r in runs}
    b_steps = budget.b_steps(vp)
    assert b_steps == budget.actor_steps + budget.warmup + -(-vp // budget.batch)
    for label, r in by_label.items():
        batch, total = smollm2_main.budget_of(r)
        assert batch == budget.batch
        a_n = smollm2_main.trajectories_at(r, budget, b_steps, "A")
        b_n = smollm2_main.trajectories_at(r, budget, b_steps, "B")
        l_n = smollm2_main.trajectories_at(r, budget, b_steps, "L")
        if smollm2_main.ROWS[label].method == "sao":
            a_end = budget.warmup + budget.actor_steps  # warm-up, then the same actor steps
            assert a_n == b_n == a_end * batch
            if smollm2_main.ROWS[label].long:  # L: B's actor steps after the warm-up, read after A's too
                assert total == l_n == (budget.warmup + b_steps) * batch
                assert f"run.eval_at=[{a_end},{budget.warmup + b_steps}]" in r.overrides
            else:
                assert total == a_n and l_n is None and f"run.eval_at=[{a_end}]" in r.overrides
            assert {f"algorithm.critic_warmup_steps={budget.warmup}", "algorithm.critic_steps=2"} <= set(r.overrides)
            if label != "sao_cold":  # budget B counts value pretraining's rollouts for the rows that use them
                assert smollm2_main.counted(r, start, b_n) == a_n + vp <= b_steps * batch < a_n + vp + batch
        else:
            assert total == b_steps * batch and (a_n, b_n, l_n) == (budget.actor_steps * batch, total, total)
            assert f"run.eval_at=[{budget.actor_steps},{b_steps}]" in r.overrides
            assert smollm2_main.counted(r, start, b_n) == b_n
        assert "run.eval_every=0" in r.overrides
    assert "trainer.mode=sync" in by_label["sao_sync"].overrides
    assert "trainer.mode=sync" not in by_label["sao"].overrides
    assert f"critic.init={tmp_path / 'critic'}" in by_label["sao"].overrides
    assert ("sao_cold" in by_label) == (task == "arith") and ("sao_long" in by_label) == (task == "chain")
    if task == "arith":
        assert not any(o.startswith("critic.init=") for o in by_label["sao_cold"].overrides)
        assert "critic.value_head_lr=5e-4" in by_label["sao_cold"].overrides  # a fresh head
    if budget is smollm2_main.FULL:  # 256 held-out tasks; the paper's critic LR: 5x the actor's 1e-5
        assert "env.eval_size=256" in by_label["sao"].overrides and "critic.optim.lr=5e-05" in by_label["sao"].overrides


def test_a_missing_smollm2_model_says_how_to_build_it(tmp_path):
    config = tmp_path / "no_model.yaml"
    config.write_text("model: {path: " + str(tmp_path / "hf") + "}\n")
    with pytest.raises(SystemExit, match="make smollm2"):
        smollm2_main.require_model(str(config))


def test_committed_result_files_are_not_ignored_by_git_and_match_the_summary():
    """The per-run files are the experiment's record across checkouts: a .gitignore pattern that
    swallows them (a bare `runs/` did) makes `git add results/` commit the summary and silently drop
    the results the next checkout needs to skip finished runs."""
    folder = REPO / "results/reproduce/main_smollm2"
    probe = subprocess.run(["git", "check-ignore", "-q", str(folder / "runs" / "probe.json")], cwd=REPO)
    assert probe.returncode == 1, "results/reproduce/main_smollm2/runs/*.json is ignored by git"
    # The current report's folder and the kept ones of earlier starts (start_<digest>/, before/).
    summaries = sorted(folder.rglob("summary.json"))
    assert len(summaries) >= 2, summaries
    for path in summaries:
        files = sorted((path.parent / "runs").glob("*.json"))
        summary = json.loads(path.read_text())
        by_name = {f"{v['label']}-s{v['seed']}-{v['key']}.json": v for v in summary["results"].values()}
        assert {f.name for f in files} == set(by_name), path
        for f in files:
            assert json.loads(f.read_text()) == by_name[f.name]


def test_the_pretrained_rows_result_is_keyed_on_the_critic_weights_too(tmp_path):
    def key(critic_digest: str) -> str:
        start = smollm2_main.SftStart("s", TOY_QUICK_CONFIG, tmp_path, (), 0.0, digest="d" * 64,
                                      pretrained=tmp_path / "value_pretrain" / "critic_pretrained",
                                      critic_digest=critic_digest, pretrain_rollouts=8)
        runs = {r.label: r for r in smollm2_main.plan(start, smollm2_main.QUICK, [1], ROWS)}
        return tuple(run_results.result_key(runs[label], start.dir, smollm2_main.start_digest(start, runs[label]))
                     for label in ("sao", "sao_cold", "grpo"))
    (paper_a, cold_a, grpo_a), (paper_b, cold_b, grpo_b) = key("a" * 64), key("b" * 64)
    assert paper_a != paper_b  # a refitted critic is another starting point
    assert cold_a == cold_b and grpo_a == grpo_b  # the rows that do not start from it


def test_table_cells_read_the_names_strict_json_gives_non_finite_numbers():
    """value-pretrain's summary.json names a NaN "nan" (run_dir.jsonable); the report reads it as a missing number."""
    assert smollm2_main._f("nan") == "-"
    assert smollm2_main._f(None) == "-"
    assert smollm2_main._f(0.1234) == "0.123"
    assert smollm2_main._f("inf") == "inf"


def test_paired_differences_are_per_seed_against_grpo_dis_and_skip_seeds_it_lacks():
    runs = [Run(label, seed, "c.yaml", ()) for label in ("sao", "grpo_dis") for seed in (1, 2, 3)]
    accs = {("sao", 1): 0.80, ("sao", 2): 0.70, ("sao", 3): 0.90, ("grpo_dis", 1): 0.85, ("grpo_dis", 2): 0.60}
    done = {r: {} if (r.label, r.seed) in accs else None for r in runs}
    paired = smollm2_main.paired_to_reference(runs, done, lambda r: accs[(r.label, r.seed)])
    assert paired["sao"].values == pytest.approx([-0.05, 0.10])  # seed 3 has no grpo_dis run to pair with
    assert paired["sao"].mean == pytest.approx(0.025)
    assert paired["grpo_dis"].values == pytest.approx([0.0, 0.0])
    against_sao = smollm2_main.paired_to_reference(runs, done, lambda r: accs[(r.label, r.seed)], reference="sao")
    assert against_sao["grpo_dis"].values == pytest.approx([0.05, -0.10])


def test_the_report_reads_the_long_sao_row_at_l_and_the_short_ones_only_at_a_and_b(tmp_path):
    """With a `sao_long` row the report adds reading L (B's actor steps for every method): sao_long's second
    evaluation and the critic-free rows' end; `sao`, evaluated once after A's steps, has no L reading."""
    from benchmarks.reproduce.experiment import Settings

    b, vp = smollm2_main.QUICK, 8
    start = smollm2_main.SftStart("s", TOY_QUICK_CONFIG, tmp_path / "start", (), 0.0, digest="d" * 64,
                                  pretrained=tmp_path / "critic", critic_digest="c" * 64, pretrain_rollouts=vp)
    b_steps = b.b_steps(vp)
    runs = [r for r in smollm2_main.plan(start, b, [1], smollm2_main.TASKS["chain"].rows)
            if r.label in ("sao", "grpo_dis", "sao_long")]
    accuracy = {"sao": [0.5], "grpo_dis": [0.4, 0.3], "sao_long": [0.6, 0.7]}

    def result(r: Run) -> dict:
        reads = [smollm2_main.trajectories_at(r, b, b_steps, x) for x in ("A", "B", "L")]
        points = sorted({n for n in reads if n is not None})
        return {"overrides": list(r.overrides), "eval_points": [[n, 1.0, a] for n, a in zip(points, accuracy[r.label])],
                "wall_s": 60.0, "cpu_s": 120.0, "load_avg": 2.0, "trajectories_per_s": 1.0, "lag_histogram": {"0": 8},
                "steps": list(range(b_steps + b.warmup)), "reward": [0.5] * (b_steps + b.warmup), "series": {},
                "start": {"digest": start.digest, "critic_digest": start.critic_digest}}
    done = {r: result(r) for r in runs}
    s = Settings("main_smollm2_chain", True, [1], 1, tmp_path / "out", tmp_path / "work", task="chain")
    smollm2_main.report(s, b, start, {"accuracy": 0.25, "n": b.eval_size}, runs, done, [], [])
    md = (tmp_path / "out" / "results.md").read_text()
    assert f"- L (budget A's convention at B's length): {b_steps} actor steps" in md
    assert f"held-out, L ({b_steps} actor steps)" in md
    assert "| sao_long | 1 | 0.600 | 0.600 | 0.700 |" in md and "| sao | 1 | 0.500 | 0.500 | - |" in md
    assert "| grpo_dis | 1 | 0.400 | 0.300 | 0.300 |" in md
    assert "value-pretraining draw" not in md  # every run from this invocation's critic
    table_l = md.split(f"L ({b_steps} actor steps,")[1].split("\n\n")[1]
    rows_l = [line.split("|")[1].strip() for line in table_l.splitlines()[2:]]
    assert rows_l == ["grpo_dis", "sao_long"]  # no L reading of `sao`
    assert "| sao_long | 1 of 1 | 0.700 (one seed) | 0.400 (one seed) |" in table_l  # paired: 0.700 - 0.300


def test_a_result_from_an_earlier_value_pretraining_draw_counts_and_the_report_names_the_draw(tmp_path):
    """Value pretraining is not bit-reproducible across sessions: a rebuilt start may hold another critic.
    An SAO result of the same SFT weights from the earlier critic counts (it is not trained again) and the
    report says which draw each run came from; a result of other SFT weights still does not count."""
    from benchmarks.reproduce.experiment import Settings
    from megatron_sao.trainer.step import ALGORITHM_VERSION

    def start(critic: str, sft: str = "d" * 64) -> smollm2_main.SftStart:
        return smollm2_main.SftStart("s", TOY_QUICK_CONFIG, tmp_path / "start", (), 0.0, digest=sft,
                                     pretrained=tmp_path / "critic", critic_digest=critic, pretrain_rollouts=8)
    folder = tmp_path / "out" / "runs"
    old, other_sft = start("a" * 64), start("a" * 64, sft="e" * 64)
    for st, seed in ((old, 1), (other_sft, 2)):
        run = next(r for r in smollm2_main.plan(st, smollm2_main.QUICK, [seed], ROWS) if r.label == "sao")
        key = run_results.result_key(run, st.dir, smollm2_main.start_digest(st, run))
        run_results.write(run_results.result_path(folder, run, key),
                          {"key": key, "algorithm_version": ALGORITHM_VERSION,
                           "start": {"digest": st.digest, "critic_digest": st.critic_digest}})
    assert smollm2_main.recorded_critics(folder, "d" * 64) == ["a" * 64]

    new = start("b" * 64)
    runs = [r for r in smollm2_main.plan(new, smollm2_main.QUICK, [1, 2], ROWS) if r.label in ("sao", "grpo")]
    s = Settings("main_smollm2", True, [1, 2], 1, tmp_path / "out", tmp_path / "work", max_runs=0)
    earlier = [c for c in smollm2_main.recorded_critics(folder, new.digest) if c != new.critic_digest]
    rec = run_results.train_missing(
        s, runs, new.dir, lambda r: smollm2_main.start_digest(new, r), lambda r: {}, 8,
        also=lambda r: [f"{new.digest}:{c}" for c in earlier] if smollm2_main.from_pretrained_critic(r) else [])
    by = {(r.label, r.seed): d for r, d in rec.done.items()}
    assert by[("sao", 1)] is not None and by[("sao", 1)]["start"]["critic_digest"] == "a" * 64
    assert by[("sao", 2)] is None and by[("grpo", 1)] is None  # other SFT weights; no grpo result at all
    assert len(rec.stale) == 1 and rec.stale[0].startswith("sao-s2-")
    text = smollm2_main.critic_draws(runs, rec.done, new.critic_digest)
    assert "from 1 value-pretraining draw of the same SFT model" in text and f"`{'a' * 16}`: sao seed 1" in text
    assert smollm2_main.critic_draws(runs, {r: None for r in runs}, new.critic_digest) == ""


def test_value_pretraining_keeps_its_rollouts_and_a_rebuilt_start_fits_on_them(tmp_path, monkeypatch):
    """The first fit's rollouts land in the results folder under the SFT digest; a checkout that rebuilds the
    same start passes them as value_pretrain.rollouts_file (no new draw), one of other SFT weights does not."""
    calls = []

    def fake_execute(run, work, threads=1, log=print):
        calls.append(run.overrides)
        d = Path(run.run_dir)
        (d / "critic_pretrained").mkdir(parents=True)
        (d / "critic_pretrained" / "config.json").write_text("{}")
        (d / "value_pretrain").mkdir()
        (d / "value_pretrain" / "summary.json").write_text(json.dumps({"rollouts": 8}))
        if not any(o.startswith("value_pretrain.rollouts_file=") for o in run.overrides):
            (d / "value_pretrain_rollouts.safetensors").write_bytes(f"draw {len(calls)}".encode())
        return RunResult(run, d, True, 1.0, cached=False)

    monkeypatch.setattr(smollm2_main, "execute", fake_execute)
    pins = tmp_path / "results"
    first = smollm2_main.pretrain_critic(_fake_start(tmp_path / "checkout1"), tmp_path / "w1", pins)
    pin = smollm2_main.rollouts_pin(pins, first.digest)
    assert not any("rollouts_file" in o for o in calls[0]) and pin.read_bytes() == b"draw 1"
    assert first.pretrain_rollouts == 8 and first.critic_digest

    smollm2_main.pretrain_critic(_fake_start(tmp_path / "checkout2"), tmp_path / "w2", pins)
    assert f"value_pretrain.rollouts_file={pin}" in calls[1] and pin.read_bytes() == b"draw 1"

    other = smollm2_main.pretrain_critic(_fake_start(tmp_path / "checkout3", digest="e" * 64), tmp_path / "w3", pins)
    assert not any("rollouts_file" in o for o in calls[2])
    assert smollm2_main.rollouts_pin(pins, other.digest).read_bytes() == b"draw 3" and pin.read_bytes() == b"draw 1"


def test_a_result_records_the_commit_its_invocation_started_from(tmp_path, monkeypatch):
    """Runs take half an hour; a commit made while one trains (the report of the one before) must not be
    recorded as the code it ran."""
    from benchmarks.reproduce.experiment import Settings

    head = ["1111111"]
    monkeypatch.setattr(run_results, "git_commit", lambda: head[0])
    monkeypatch.setattr(run_results, "summarize", lambda res, batch: {})

    def fake_execute_all(todo, work, jobs, fresh, log, on_done):
        head[0] = "2222222"  # committed while the run trained
        for run in todo:
            on_done(RunResult(run, tmp_path / "run", True, 1.0, cached=False))

    monkeypatch.setattr(run_results, "execute_all", fake_execute_all)
    st = _fake_start(tmp_path / "start")
    runs = [r for r in smollm2_main.plan(st, smollm2_main.QUICK, [1], ROWS) if r.label == "grpo"]
    s = Settings("main_smollm2", True, [1], 1, tmp_path / "out", tmp_path / "work")
    rec = run_results.train_missing(s, runs, st.dir, lambda r: st.digest, lambda r: {}, 8)
    assert [d["commit"] for d in rec.done.values()] == ["1111111"]


def test_the_sft_accuracy_is_evaluated_once_per_sft_weights_and_kept_for_later_sessions(tmp_path, monkeypatch):
    """vLLM's sampling on the CPU is not bit-reproducible across sessions: the first evaluation of an SFT
    start lands in the results folder and a rebuilt start reads it instead of evaluating again."""
    evaluated = []

    def fake_evaluate(self, eval_size, log=print):
        evaluated.append(self.dir)
        return {"model": str(self.sft_model), "accuracy": [0.25, 0.5, 0.75][len(evaluated) - 1], "n": eval_size}

    monkeypatch.setattr(smollm2_main.SftStart, "evaluate_sft", fake_evaluate)
    pins = tmp_path / "results"
    first = smollm2_main.sft_accuracy(_fake_start(tmp_path / "checkout1"), pins, 16)
    assert first["accuracy"] == 0.25 and first["n"] == 16
    pin = smollm2_main.sft_eval_pin(pins, "d" * 64, 16)
    assert json.loads(pin.read_text()) == {"sft_digest": "d" * 64, "eval_seed": smollm2_main.EVAL_SEED,
                                           "accuracy": 0.25, "n": 16}
    again = smollm2_main.sft_accuracy(_fake_start(tmp_path / "checkout2"), pins, 16)  # another session, same weights
    assert again["accuracy"] == 0.25 and len(evaluated) == 1
    other = smollm2_main.sft_accuracy(_fake_start(tmp_path / "checkout3", digest="e" * 64), pins, 16)
    assert other["accuracy"] == 0.5 and len(evaluated) == 2  # other SFT weights are evaluated
    assert smollm2_main.sft_accuracy(_fake_start(tmp_path / "checkout4"), pins, 32)["accuracy"] == 0.75  # other size
    assert not list(pins.rglob("*.tmp"))
