"""`sao bench main --model smollm2`: the issue-27 harness, end to end at toy scale (`--quick`); the decisions
it makes without running anything are checked in tests/unit/reproduce/test_smollm2_main.py.
"""

from __future__ import annotations

import json
import shutil

import pytest

from benchmarks.reproduce import smollm2_main
from benchmarks.reproduce.__main__ import main as bench_main


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_harness_writes_a_result_per_run_skips_it_after_and_reports_the_missing(tmp_path, capsys):
    from megatron_sao.trainer.step import ALGORITHM_VERSION

    work, out = tmp_path / "work", tmp_path / "results"
    argv = ["main", "--model", "smollm2", "--quick", "--max-runs", "1", "--work", str(work), "--out", str(out)]
    folder = out / "main_smollm2"

    assert bench_main(argv) == 0
    first = capsys.readouterr().out
    assert "start train          sao-s1-" in first and first.count("start train") == 1
    files = sorted((folder / "runs").glob("*.json"))
    assert [f.name.split("-")[0] for f in files] == ["sao"]
    data = json.loads(files[0].read_text())
    assert files[0].stem.endswith("-" + data["key"]) and data["algorithm_version"] == ALGORITHM_VERSION
    b = smollm2_main.QUICK
    assert data["trajectories"] == (b.warmup + b.actor_steps) * b.batch  # what the run consumed, from its metrics
    assert [p[0] for p in data["eval_points"]] == [(b.warmup + b.actor_steps) * b.batch]  # once, at its end
    assert data["start"]["n"] == b.eval_size and data["trajectories_per_s"] > 0
    assert data["start"]["pretrain_rollouts"] == 8  # the quick config's value_pretrain.rollouts: budget B's count
    pinned = list((folder / "start").glob("value_pretrain_rollouts-*.safetensors"))  # a rebuilt start fits on them
    assert [p.name for p in pinned] == [smollm2_main.rollouts_pin(folder, data["start"]["digest"]).name]
    sft = json.loads(smollm2_main.sft_eval_pin(folder, data["start"]["digest"], b.eval_size).read_text())
    assert sft["accuracy"] == data["start"]["accuracy"]  # kept: a later session reads the runs against it
    assert data["load_avg"] >= 0  # sampled while the run trained: its wall time's context
    assert 0 < data["cpu_s"]  # the run's process tree: the figure a shared machine does not inflate
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["complete"] is False and summary["budget"]["b_steps"] == b.b_steps(8)
    assert summary["missing"] == ["sao_sync/s1", "grpo/s1", "grpo_dis/s1", "running_mean/s1", "sao_cold/s1"]
    md = (folder / "results.md").read_text()
    assert "PARTIAL: 1 of 6 runs finished" in md
    assert "The critic over the first 10 actor steps" in md  # the SAO run's early critic diagnostics
    assert "The pretrained critic: value-pretrained on 8 rollouts" in md
    assert "Budget A (16 trajectories), per method" in md and "Budget B (" in md
    assert any(k.startswith("critic/value_mean") for k in data["series"])  # per-step critic diagnostics kept
    for label in ("sao_sync", "grpo", "grpo_dis", "running_mean", "sao_cold"):
        assert f"| {label} | 1 |" in md and f"{label} seed 1" in md.split("Missing")[1].split("\n")[0]
    assert (folder / smollm2_main.FIGURE).stat().st_size > 5000
    # The configuration block names the SFT model as the result files do, not by this machine's path.
    config_block = md.split("Exact configuration")[1]
    assert "actor.init=<start>/sft_model" in config_block and str(work) not in config_block

    # A later session: no runs/ cache (another checkout), the result file alone says the run is done.
    shutil.rmtree(work / "runs")
    before = (files[0].read_bytes(), files[0].stat().st_mtime_ns)
    assert bench_main([*argv, "--rows", "grpo"]) == 0
    second = capsys.readouterr().out
    assert "start train          sao-s1-" not in second and "start sft" not in second
    assert "start train          grpo-s1-" in second  # --rows: the next missing run of that row, not sao_sync
    assert (files[0].read_bytes(), files[0].stat().st_mtime_ns) == before
    assert len(list((folder / "runs").glob("*.json"))) == 2
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["missing"] == ["sao_sync/s1", "grpo_dis/s1", "running_mean/s1", "sao_cold/s1"]
    assert set(summary["results"]) == {"sao/s1", "grpo/s1"}
    grpo = summary["results"]["grpo/s1"]  # budget B's steps, read after budget A's and at the end
    assert [p[0] for p in grpo["eval_points"]] == [b.actor_steps * b.batch, b.b_steps(8) * b.batch]
    assert "PARTIAL: 2 of 6 runs finished" in (folder / "results.md").read_text()
    assert "start value-pretrain" not in second  # the critic came from the start's directory (or the cache)

    # The chain task's report: its own folder and rows (no cold-critic row, a long SAO row), from the same toy start.
    assert bench_main(["main", "--model", "smollm2", "--quick", "--task", "chain", "--max-runs", "0",
                       "--work", str(work), "--out", str(out)]) == 0
    chain = json.loads((out / "main_smollm2_chain" / "summary.json").read_text())
    assert chain["task"] == "chain" and chain["missing"] == ["sao/s1", "sao_sync/s1", "grpo/s1", "grpo_dis/s1",
                                                             "running_mean/s1", "sao_long/s1"]
