"""`sao bench main --model smollm2`: the decisions the issue-27 harness makes without running anything:
which result files count as done, equal budgets (the harness end to end: tests/e2e/test_smollm2_main_quick.py).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks.reproduce import run_results, smollm2_main
from benchmarks.reproduce.runner import Run
from benchmarks.reproduce.starts import TOY_QUICK_CONFIG
from tests.paths import REPO


def _fake_start(d: Path, digest: str = "d" * 64) -> smollm2_main.SftStart:
    return smollm2_main.SftStart("toy_sft", TOY_QUICK_CONFIG, d, (), 0.0, digest=digest)


def test_result_key_changes_with_config_algorithm_version_and_sft_weights_not_with_the_start_path(tmp_path,
                                                                                                  monkeypatch):
    from megatron_sao.trainer import step

    b = smollm2_main.QUICK
    start = _fake_start(tmp_path / "a" / "toy_sft-1")
    run = smollm2_main.plan(start, b, [1])[0]
    key = run_results.result_key(run, start.dir, start.digest)
    path = run_results.result_path(tmp_path, run, key)
    run_results.write(path, {"key": key, "algorithm_version": step.ALGORITHM_VERSION})
    assert run_results.load(path, key) is not None

    # The same SFT weights built elsewhere (another checkout): the same result.
    moved = _fake_start(tmp_path / "b" / "toy_sft-1")
    assert run_results.result_key(smollm2_main.plan(moved, b, [1])[0], moved.dir, moved.digest) == key
    # Other SFT weights, another override, another seed: another result file.
    assert run_results.result_key(run, start.dir, "e" * 64) != key
    changed = Run(run.label, run.seed, run.config, (*run.overrides, "algorithm.critic_steps=1"))
    assert run_results.result_key(changed, start.dir, start.digest) != key
    assert run_results.result_key(smollm2_main.plan(start, b, [2])[0], start.dir, start.digest) != key
    # A code change that makes the same config train differently: the old file is not this run's result.
    monkeypatch.setattr(step, "ALGORITHM_VERSION", step.ALGORITHM_VERSION + 1)
    new_key = run_results.result_key(run, start.dir, start.digest)
    assert new_key != key and not run_results.result_path(tmp_path, run, new_key).exists()
    assert run_results.stale(tmp_path, {run: run_results.result_path(tmp_path, run, new_key)}) == [path.name]
    other_seed = smollm2_main.plan(start, b, [2])[0]  # not a run of this invocation: not its stale file
    assert run_results.stale(tmp_path, {other_seed: run_results.result_path(tmp_path, other_seed, new_key)}) == []
    with pytest.raises(ValueError, match="delete the file"):  # and the old file is never read as the new one
        run_results.load(path, key)


@pytest.mark.parametrize("budget,config", [(smollm2_main.QUICK, TOY_QUICK_CONFIG),
                                           (smollm2_main.FULL, smollm2_main.CONFIG)])
def test_every_method_sees_the_same_trajectories_per_actor_step_and_in_total(tmp_path, budget, config):
    start = smollm2_main.SftStart("s", config, tmp_path, (), 0.0, digest="d", pretrained=tmp_path / "critic")
    runs = smollm2_main.plan(start, budget, smollm2_main.DEFAULT_SEEDS)
    assert sorted({r.label for r in runs}) == sorted(smollm2_main.ROWS) and len(runs) == 5 * 2
    budgets = {r.label: smollm2_main.budget_of(r) for r in runs}
    assert set(budgets.values()) == {(budget.batch, budget.batch * budget.steps)}, budgets
    by_label = {r.label: r for r in runs}
    assert "trainer.mode=sync" in by_label["sao_sync"].overrides
    assert "trainer.mode=sync" not in by_label["sao"].overrides
    if budget is smollm2_main.FULL:  # the paper's settings: 128 held-out tasks; SAO 20 actor steps after warm-up
        assert "env.eval_size=128" in by_label["sao"].overrides
        assert "run.total_steps=20" in by_label["sao"].overrides and "run.total_steps=25" in by_label["grpo"].overrides
        # the paper's critic: 10 warm-up steps charged to the same budget, K=2, critic LR 5x the actor's 1e-5
        paper = by_label["sao_pretrained"].overrides
        assert {"run.total_steps=15", "algorithm.critic_warmup_steps=10", "algorithm.critic_steps=2",
                "critic.optim.lr=5e-05", f"critic.init={tmp_path / 'critic'}"} <= set(paper)
    assert not any(o.startswith("critic.init=") for o in by_label["sao"].overrides)  # the recipe's critic


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
    files = sorted((folder / "runs").glob("*.json"))
    probe = subprocess.run(["git", "check-ignore", "-q", str(folder / "runs" / "probe.json")], cwd=REPO)
    assert probe.returncode == 1, "results/reproduce/main_smollm2/runs/*.json is ignored by git"
    summary = json.loads((folder / "summary.json").read_text())
    by_name = {f"{v['label']}-s{v['seed']}-{v['key']}.json": v for v in summary["results"].values()}
    assert {f.name for f in files} == set(by_name)
    for f in files:
        assert json.loads(f.read_text()) == by_name[f.name]


def test_the_pretrained_rows_result_is_keyed_on_the_critic_weights_too(tmp_path):
    def key(critic_digest: str) -> str:
        start = smollm2_main.SftStart("s", TOY_QUICK_CONFIG, tmp_path, (), 0.0, digest="d" * 64,
                                      pretrained=tmp_path / "value_pretrain" / "critic_pretrained",
                                      critic_digest=critic_digest)
        runs = {r.label: r for r in smollm2_main.plan(start, smollm2_main.QUICK, [1])}
        return (run_results.result_key(runs["sao_pretrained"], start.dir, smollm2_main.start_digest(start,
                                                                                                 runs["sao_pretrained"])),
                run_results.result_key(runs["sao"], start.dir, smollm2_main.start_digest(start, runs["sao"])))
    (paper_a, sao_a), (paper_b, sao_b) = key("a" * 64), key("b" * 64)
    assert paper_a != paper_b  # a refitted critic is another starting point
    assert sao_a == sao_b  # the recipe's rows do not start from it


def test_table_cells_read_the_names_strict_json_gives_non_finite_numbers():
    """value-pretrain's summary.json names a NaN "nan" (run_dir.jsonable); the report reads it as a missing number."""
    assert smollm2_main._f("nan") == "-"
    assert smollm2_main._f(None) == "-"
    assert smollm2_main._f(0.1234) == "0.123"
    assert smollm2_main._f("inf") == "inf"


def test_paired_differences_are_per_seed_against_grpo_dis_and_skip_seeds_it_lacks():
    def data(acc):
        return {"eval_points": [[400, 10.0, acc]]}

    runs = [Run(label, seed, "c.yaml", ()) for label in ("sao", "grpo_dis") for seed in (1, 2, 3)]
    accs = {("sao", 1): 0.80, ("sao", 2): 0.70, ("sao", 3): 0.90, ("grpo_dis", 1): 0.85, ("grpo_dis", 2): 0.60}
    done = {r: data(accs[(r.label, r.seed)]) if (r.label, r.seed) in accs else None for r in runs}
    paired = smollm2_main.paired_to_reference(runs, done, 400)
    assert paired["sao"].values == pytest.approx([-0.05, 0.10])  # seed 3 has no grpo_dis run to pair with
    assert paired["sao"].mean == pytest.approx(0.025)
    assert paired["grpo_dis"].values == pytest.approx([0.0, 0.0])
