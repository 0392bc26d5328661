"""`sao bench all --quick`: every paper-reproduction experiment runs end to end and writes its report.

The quick budgets are far too small for the numbers to mean anything; this checks the pipeline:
starting points (sft -> value-pretrain), every method and variant as a real `sao train`, the
reports (results.md with a row per method, summary.json, PNG figures), and the run cache. Its runs
are also the suite's `sao train` runs of GRPO, the running-mean baseline, step-level GAE and an
unfrozen critic attention: what each switch changes in the run's records is checked here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO

EXPERIMENTS = {  # experiment -> (figures, labels that must appear in results.md)
    "main": (["main_comparison.png"], ["sft (start)", "grpo", "grpo_dis", "sao"]),
    "ablations": (["ablations.png"], ["k1", "attention_trained", "running_mean", "no_value_pretrain",
                                      "step_gae_avg", "step_gae_last"]),
    "staleness": (["staleness_curves.png", "staleness_final_eval.png"], ["grpo", "grpo_dis", "sao"]),
    "online": (["online_style_shift.png"], ["sao", "running_mean"]),
    "throughput": (["throughput.png"], ["sync", "async", "async / sync"]),
}


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_all_experiments_quick(tmp_path):
    work, out = tmp_path / "work", tmp_path / "results"
    cmd = [sys.executable, "-m", "megatron_sao.cli", "bench", "all", "--quick", "--jobs", "2",
           "--work", str(work), "--out", str(out)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1400)
    assert p.returncode == 0, f"sao bench all --quick failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    for name, (figures, labels) in EXPERIMENTS.items():
        d = out / name
        md = (d / "results.md").read_text()
        assert "- command: `sao bench all --quick" in md
        for label in labels:
            assert f"| {label} |" in md, (name, label)
        for fig in figures:
            assert (d / fig).stat().st_size > 5000, (name, fig)  # a rendered PNG, not an empty file
            assert f"]({fig})" in md
        data = json.loads((d / "summary.json").read_text())
        assert data["failed"] == []
    # SAO's reference run is shared by the main comparison and the ablations: trained once.
    main_runs = json.loads((out / "main" / "summary.json").read_text())["runs"]
    ablation_runs = json.loads((out / "ablations" / "summary.json").read_text())["runs"]
    assert main_runs["sao/s1"] == ablation_runs["sao/s1"]
    assert len({d.name for d in (work / "runs").iterdir() if d.name.startswith("sao-s1-")}) == 2  # + online's
    _check_algorithm_switches(main_runs, ablation_runs)
    # A second invocation reuses every finished run instead of training again.
    p2 = subprocess.run([*cmd[:4], "main", *cmd[5:]], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p2.returncode == 0, p2.stderr[-3000:]
    assert "start train" not in p2.stdout and "start sft" not in p2.stdout
    _check_dynamics(cmd, work, out, env)
    _check_online_recorded(cmd, work, out, env)


def _check_dynamics(cmd: list[str], work: Path, out: Path, env: dict) -> None:
    """The long-run experiment (not in `all`): one run trained and committed as a result file, the
    report partial and naming the rest; a second invocation trains nothing and rebuilds the report."""
    dyn = [*cmd[:4], "dynamics", "--quick", "--work", str(work), "--out", str(out)]
    p = subprocess.run([*dyn, "--max-runs", "1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    files = list((out / "dynamics" / "runs").glob("sao-s1-*.json"))
    assert len(files) == 1, files
    result = json.loads(files[0].read_text())
    assert result["steps"] == [0, 1, 2, 3]  # one critic warm-up step, then three actor steps
    assert "trainer.policy_lag=4" in result["overrides"] and "<start>" in " ".join(result["overrides"])
    md = (out / "dynamics" / "results.md").read_text()
    assert "PARTIAL: 1 of 4 runs finished" in md and "grpo seed 1" in md and "| sao | 1 |" in md
    assert (out / "dynamics" / "start" / "sft_model" / "config.json").is_file()  # the start, pinned
    # Another session (a new work directory, the results folder from git): the pinned start, not a rebuilt
    # one, so the committed run is found (its key holds the start's digest) and nothing trains.
    again = [*cmd[:4], "dynamics", "--quick", "--work", str(work.parent / "work_next_session"), "--out", str(out),
             "--max-runs", "0"]
    p = subprocess.run(again, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "from the pinned start" in p.stdout and "start sft" not in p.stdout and "start train" not in p.stdout
    assert "PARTIAL: 1 of 4 runs finished" in (out / "dynamics" / "results.md").read_text()
    # The stress regime: its own folder and runs, from the same pinned start.
    p = subprocess.run([*again, "--stress"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "start sft" not in p.stdout and "start train" not in p.stdout  # the start restored above
    stress = json.loads((out / "dynamics_stress" / "summary.json").read_text())
    assert stress["regime"] == {"policy_lag": 8, "staleness": 8, "actor_lr": 2e-4}
    assert stress["missing"] == [f"{row}/s1" for row in ("sao", "grpo", "grpo_dis", "running_mean", "sao_critic_lr4x",
                                                         "sao_critic_k4")]


def _check_online_recorded(cmd: list[str], work: Path, out: Path, env: dict) -> None:
    """`online --model smollm2` keeps a result file per run, as the SmolLM2 runs need (--quick: the toy's style
    start, which `all` built above): one run trained and recorded, the report partial and naming the other."""
    online = [*cmd[:4], "online", "--model", "smollm2", "--quick", "--work", str(work), "--out", str(out),
              "--max-runs", "1"]
    p = subprocess.run(online, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "start sft" not in p.stdout  # the style start of `all`
    result = json.loads(next((out / "online_smollm2" / "runs").glob("sao-s1-*.json")).read_text())
    assert result["steps"] == [0, 1, 2] and "env.kwargs.switch_every=1" in result["overrides"]
    md = (out / "online_smollm2" / "results.md").read_text()
    assert "PARTIAL: 1 of 2 runs finished; missing running_mean seed 1" in md and "| sao | 1 |" in md


def _lines(run_dir: str, name: str) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / name).read_text().splitlines()]


def _check_algorithm_switches(main_runs: dict, ablation_runs: dict) -> None:
    """What each algorithm switch changes in a real `sao train` (these runs are the suite's only ones of
    GRPO, the running-mean baseline and an unfrozen critic attention)."""
    grpo = main_runs["grpo/s1"]  # whole groups: 2 prompts x 4 rollouts, PPO clip loss, no critic
    rows = _lines(grpo, "metrics.jsonl")
    assert [r["version"] for r in rows] == [0, 1]
    for b in _lines(grpo, "batches.jsonl"):
        assert sorted(b["prompt_ids"].count(p) for p in set(b["prompt_ids"])) == [4, 4]
    assert "actor/clip_fraction" in rows[-1] and "critic/loss" not in rows[-1]
    rows = _lines(ablation_runs["running_mean/s1"], "metrics.jsonl")
    assert [r["version"] for r in rows] == [0, 1]
    assert "baseline" in rows[-1] and "critic/loss" not in rows[-1]
    assert rows[0]["baseline"] == 0.0
    # Step-level GAE trains (SAO's warm-up step, then one actor step); attention left out of the
    # frozen set gets gradient, the reference's frozen attention none.
    rows = _lines(ablation_runs["step_gae_avg/s1"], "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1] and "actor/loss" not in rows[0]
    assert "actor/loss" in rows[1] and "critic/loss" in rows[1]
    # Which groups the critic trains, from the trainer's own count; gradients show it only where a value error
    # reaches the backbone (the quick toy policy may earn no reward: a zero value head then sees none).
    def log(label: str) -> str:
        return (Path(ablation_runs[label]) / "train.log").read_text()
    assert re.search(r"attention [\d,]+ trainable", log("attention_trained/s1"))
    assert re.search(r"attention [\d,]+ frozen", log("sao/s1"))
    for r in _lines(ablation_runs["attention_trained/s1"], "metrics.jsonl"):
        assert (r["critic/grad_norm/attention"] > 0.0) == (r["critic/grad_norm/moe"] > 0.0), r
    assert all(r["critic/grad_norm/attention"] == 0.0 for r in _lines(ablation_runs["sao/s1"], "metrics.jsonl"))
