"""The critic `sao train` builds (frozen-attention preset, whole-model parameter counts per group,
LR schedule) on one rank and on two (TP=2+SP+EP=2, PP=2), and vanilla GRPO's update."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.integration.megatron.result_lines import parse_tagged
from tests.launch import torchrun_cmd
from tests.paths import REPO

WORKER = "tests.integration.megatron.workers.algo_engine"
# tiny qwen3_moe (megatron_sao/models/presets.py): vocab 128, hidden 64, 2 layers, 4 experts of 32.
VOCAB, HIDDEN, LAYERS, EXPERTS, MOE_FFN = 128, 64, 2, 4, 32

pytestmark = pytest.mark.slow  # a worker subprocess and a 2-rank torchrun launch


def _run(cmd) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "ALGO_ENGINE DONE" in proc.stdout
    return parse_tagged(proc.stdout)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("algo_engine")
    out = _run([sys.executable, "-m", WORKER, str(tmp), "single"])
    out.update(_run(torchrun_cmd(2, "-m", WORKER, str(tmp), "tp2sp_ep2", "pp2")))
    return out


def test_default_critic_freezes_what_the_paper_freezes(results):
    r = results["single"]
    frozen, trainable = set(r["frozen"]), set(r["trainable"])
    assert "embedding.word_embeddings.weight" in frozen  # trained before: 311M parameters on Qwen3-30B-A3B
    assert "decoder.final_layernorm.weight" in frozen
    for layer in range(LAYERS):
        p = f"decoder.layers.{layer}."
        for name in ("input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                     "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",
                     "mlp.router.weight", "pre_mlp_layernorm.weight"):
            assert p + name in frozen, p + name
    assert trainable == {f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc{k}.weight"
                         for i in range(LAYERS) for e in range(EXPERTS) for k in (1, 2)} | {"value_head.weight",
                                                                                            "value_head.bias"}
    assert r["frozen_max_change"] == 0.0 and r["trainable_unchanged"] == 0 and not r["skipped"]


def test_parameter_counts_per_group_are_the_whole_models_on_every_layout(results):
    counts = results["single"]["counts"]
    assert counts["embeddings"] == {"trainable": 0, "frozen": VOCAB * HIDDEN}
    assert counts["experts"] == {"trainable": LAYERS * EXPERTS * 3 * MOE_FFN * HIDDEN, "frozen": 0}
    assert counts["router"] == {"trainable": 0, "frozen": LAYERS * EXPERTS * HIDDEN}
    assert counts["value_head"] == {"trainable": HIDDEN + 1, "frozen": 0}
    assert counts["norms"]["trainable"] == counts["attention"]["trainable"] == 0
    for layout in ("tp2sp_ep2", "pp2"):  # shards, replicas and stages counted once
        assert results[layout]["counts"] == counts, layout
        assert results[layout]["frozen_max_change"] == 0.0 and results[layout]["trainable_unchanged"] == 0


def test_critic_lr_schedule_covers_the_warmup_steps(results):
    # (critic_warmup_steps 3 + total_steps 5) * critic_steps 2 optimizer steps; the warm-up ones were left out.
    assert results["single"]["decay_steps"] == 16


def test_vanilla_grpo_equals_an_explicit_old_policy_forward(results):
    r = results["vanilla_grpo"]
    assert r["param_change"] > 1e-3
    assert r["param_max_abs_diff"] <= 1e-6, r  # the same update (bit-exact on this CPU)
    assert r["loss"][0] == pytest.approx(r["loss"][1], rel=1e-5, abs=1e-7)
    assert r["clip_fraction"] == [0.0, 0.0]
