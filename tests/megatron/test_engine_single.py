"""Single-process MegatronEngine checks (one subprocess runs all of them; each test reads its part).

The engine runs in a subprocess because `ensure_cpu_compat()` patches torch process-wide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
WORKER = os.path.join(os.path.dirname(__file__), "workers", "engine_single.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine_single")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, WORKER, str(tmp)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "ENGINE_SINGLE DONE" in proc.stdout
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            _, tag, payload = line.split(" ", 2)
            out[tag] = json.loads(payload)
    return out


def test_logprobs_match_hf(results):
    r = results["hf_logprobs"]
    assert r["shape"] == [5, 11]
    assert r["max_abs_diff"] <= 1e-5


def test_step_matches_torch_adamw_with_clipping(results):
    r = results["adamw_ref"]
    assert not r["skipped"] and r["state_version"] == 1
    assert r["ref_grad_norm"] > 0.5  # clip_grad=0.5: clipping is active in this step
    assert abs(r["grad_norm"] - r["ref_grad_norm"]) <= 1e-5 * r["ref_grad_norm"]
    assert abs(r["loss"] - r["ref_loss"]) <= 1e-5
    assert r["param_change"] > 1e-3  # the step moved the weights...
    assert r["param_max_abs_diff"] <= 2e-5  # ...exactly as torch AdamW did


def test_nan_loss_skips_step(results):
    r = results["nan_skip"]
    assert r["skipped"] and not r["grad_norm_finite"]
    assert r["param_change"] == 0.0
    assert r["adam_steps"][0] == r["adam_steps"][1]
    assert not r["next_step_skipped"] and r["next_step_change"] > 0
    assert r["state_version"] == 2  # 2 successful steps, the skipped one not counted


def test_save_load_resumes_exactly(results):
    r = results["save_load"]
    assert r["param_max_abs_diff"] == 0.0
    assert r["loss_a"] == r["loss_b"]
    assert r["version_after_load"] == 1
    assert not r["tmp_left"]


def test_frozen_attention_critic(results):
    r = results["frozen_critic"]
    assert r["n_frozen"] == 10 and r["n_trainable"] > 0
    assert r["frozen_max_change"] == 0.0
    assert r["trainable_min_change"] > 0.0
    assert r["values_shape"] == [5, 11] and r["values_pad_zero"]
    assert r["loss_decreased"]
    m = r["metrics"]
    assert m["grad_norm/attention"] == 0.0 and m["grad_norm/moe"] > 0 and m["grad_norm/value_head"] > 0
    assert m["action_count"] == 29.0


def test_hf_export_round_trip(results):
    r = results["export"]
    assert r["missing"] == [] and r["extra"] == []
    assert r["max_abs_diff"] == 0.0
    assert r["n_buckets"] > 1 and r["max_multi_bucket_bytes"] <= 64 << 10


def test_bad_batches_raise_clear_errors(results):
    r = results["errors"]
    assert r["left_pad"].startswith("ValueError") and "right-padded" in r["left_pad"]
    assert r["packed"].startswith("NotImplementedError") and "packed" in r["packed"]
    assert r["float_tokens"].startswith("ValueError") and "int64" in r["float_tokens"]
