"""`make gpu-check-smoke`: tools/gpu_check.py end to end on the CPU (tiny shapes, gloo, fp32).

The GPU run writes the same JSON with bf16 figures; here every section must run and its figures be
sane, and a section that breaks must be recorded without stopping the others.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.py")
SECTIONS = ["env", "build", "parity", "export", "train", "memory", "generate", "mfu"]


def _run(tmp_path, *args):
    out = tmp_path / "figures.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(out), "--smoke", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    return proc, json.loads(out.read_text())


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    proc, fig = _run(tmp_path_factory.mktemp("gpu_check"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return fig


@pytest.mark.slow
def test_every_section_ran_and_passed(figures):
    assert list(figures["sections"]) == SECTIONS
    assert figures["failed_sections"] == []
    assert all(s["ok"] and s["seconds"] >= 0 for s in figures["sections"].values())


@pytest.mark.slow
def test_figures_are_sane(figures):
    s = figures["sections"]
    assert s["env"]["mode"] == "smoke" and s["env"]["dtype"] == "float32" and s["env"]["megatron_core"]
    assert s["build"]["backend"] == "gloo" and s["build"]["actor_param_dtypes"] == ["torch.float32"]
    assert s["parity"]["logprob_max_abs_diff"] <= 1e-4 and s["parity"]["values_finite"]
    assert s["export"]["buckets"] >= 2 and s["export"]["max_abs_diff"] == 0.0 and s["export"]["missing"] == []
    assert s["export"]["biggest_bucket_bytes"] <= 32 << 10  # the smoke bucket limit (one tensor may exceed it)
    for role in ("actor", "critic"):
        assert not s["train"][role]["skipped"] and math.isfinite(s["train"][role]["loss"])
    assert s["train"]["logprob_change_after_step"] > 0
    m = s["memory"]
    assert m["planned_layer_bytes"] > 0 and all(b > 0 for b in m["saved_for_backward_layer_bytes"])
    assert 0.5 < m["saved_ratio_to_planned"] < 10  # fp32 activations against a bf16 formula: same order
    assert s["generate"]["tokens"] == 4 * 8 and s["generate"]["device"] == "cpu"
    assert s["mfu"]["tflops_step"] > 0 and 0 < s["mfu"]["mfu_step"] < 1 and s["mfu"]["fwd_bwd_s"] <= s["mfu"]["step_s"]


@pytest.mark.slow
def test_a_broken_section_is_recorded_and_the_run_goes_on(tmp_path):
    proc, fig = _run(tmp_path, "--sections", "env,export,generate")  # nothing built: export and generate fail
    assert proc.returncode == 1
    assert fig["sections"]["env"]["ok"]
    for name in ("export", "generate"):
        assert not fig["sections"][name]["ok"] and fig["sections"][name]["error"].startswith("KeyError")
    assert fig["failed_sections"] == ["export", "generate"]
