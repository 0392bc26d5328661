"""`sao bench all --quick`: every paper-reproduction experiment runs end to end and writes its report.

The quick budgets are far too small for the numbers to mean anything; this checks the pipeline:
starting points (sft -> value-pretrain), every method and variant as a real `sao train`, the
reports (results.md with a row per method, summary.json, PNG figures), and the run cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1400)
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
    # A second invocation reuses every finished run instead of training again.
    p2 = subprocess.run([*cmd[:4], "main", *cmd[5:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p2.returncode == 0, p2.stderr[-3000:]
    assert "start train" not in p2.stdout and "start sft" not in p2.stdout
