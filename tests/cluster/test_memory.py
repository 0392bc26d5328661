"""Memory formulas against hand calculations of the published formulas."""

import json

import pytest

from megatron_sao.cluster import memory as mem
from megatron_sao.models.hf_config import model_spec_from_hf
from tests.cluster.recipes import QWEN_JSON as QWEN


@pytest.fixture(scope="module")
def spec():
    return model_spec_from_hf(json.loads(QWEN.read_text()))


def test_qwen3_30b_a3b_param_count(spec):
    c = mem.count_params(spec)
    h, v = 2048, 151936
    attention = h * (32 * 128 + 2 * 4 * 128) + 32 * 128 * h  # q,k,v + o
    experts = 128 * 3 * h * 768
    per_layer = attention + 2 * 128 + 2 * h + 128 * h + experts  # + q/k norm, 2 norms, router
    total = 2 * v * h + h + 48 * per_layer
    active = 2 * v * h + h + 48 * (per_layer - experts + 8 * 3 * h * 768)
    assert c.total == total == 30_532_122_624
    assert c.active == active == 3_353_032_704
    assert 30.4e9 < c.total < 30.6e9 and 3.2e9 < c.active < 3.4e9  # "30.5B total / 3.3B active"


def test_distributed_optimizer_bytes_per_param():
    # Megatron-LM distributed optimizer docs: 18 bytes/param -> 6 + 12/d.
    assert mem.trainable_bytes_per_param(1) == 18
    assert mem.trainable_bytes_per_param(1, distributed_optimizer=False) == 18
    assert mem.trainable_bytes_per_param(8) == 6 + 12 / 8
    assert mem.trainable_bytes_per_param(8, distributed_optimizer=False) == 18
    assert mem.FROZEN_BYTES_PER_PARAM == 2
    with pytest.raises(ValueError, match="data-parallel"):
        mem.trainable_bytes_per_param(0)


def test_korthikanti_formula_verbatim():
    s, b, h, a = 2048, 4, 4096, 32
    assert mem.korthikanti_layer_bytes(s, b, h, a) == s * b * h * 34 + 5 * a * s * s * b
    assert mem.korthikanti_layer_bytes(s, b, h, a, t=8) == s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert mem.korthikanti_layer_bytes(s, b, h, a, t=8, sequence_parallel=True) == pytest.approx(
        (34 * s * b * h + 5 * a * s * s * b) / 8)


@pytest.mark.parametrize("t,sp", [(1, False), (2, False), (8, False), (2, True), (8, True)])
def test_generalised_accounting_reduces_to_korthikanti(t, sp):
    s, b, h, a = 2048, 2, 4096, 32
    got = mem.layer_activation_bytes(mem.LayerShape.gpt(h, a), s, b, t, sp, flash_attention=False)
    assert got == pytest.approx(mem.korthikanti_layer_bytes(s, b, h, a, t, sp), rel=1e-12)


def test_qwen3_moe_layer_by_hand(spec):
    s, b, tp, sb = 4096, 1, 4, 4096
    h, q, kv, a, k, f, E = 2048, 4096, 512, 32, 8, 768, 128
    shared = sb * (4 * h + 2 * h + 2 * h) + 4 * sb * E  # two norm inputs, qkv input, router input; fp32 probs
    split = 2 * sb * (q + kv) + 2 * sb * kv + 2 * sb * q + 2 * sb * (q + kv) + 4 * a * sb  # QK, V, proj, qk-norm, lse
    copies = sb * k / tp  # etp=1: routed copies per rank
    moe = copies * (2 * h + 2 * (2 * f) + 2 * f)  # fc1 input, SwiGLU input (gate+up), SwiGLU output
    expected = shared / tp + split / tp + moe
    got = mem.layer_activation_bytes(mem.LayerShape.from_spec(spec), s, b, tp, True, True, etp=1)
    assert got == pytest.approx(expected, rel=1e-12)
    # Without sequence parallel the shared terms stay whole on every TP rank.
    got_nosp = mem.layer_activation_bytes(mem.LayerShape.from_spec(spec), s, b, tp, False, True, etp=1)
    assert got_nosp == pytest.approx(shared + split / tp + moe, rel=1e-12)


def test_recompute_and_logits():
    assert mem.recompute_layer_bytes(2048, 4096, 2) == 2 * 4096 * 2 * 2048
    assert mem.recompute_layer_bytes(2048, 4096, 2, tp=4, sequence_parallel=True) == 2 * 4096 * 2 * 2048 / 4
    # bf16 logits, two fp32 buffers of a 512-row chunk, 33 bytes of per-token vectors (megatron/logprobs.py)
    assert mem.logits_bytes(151936, 1024, 1, tp=4) == 1024 * (151936 / 4) * 2 + 2 * 512 * (151936 / 4) * 4 + 1024 * 33
    # 128K tokens: the chunk stays 512 rows, the logits grow with the sequence
    assert mem.logits_bytes(151936, 131072, 1, tp=4) == 131072 * (151936 / 4) * 2 + 2 * 512 * (151936 / 4) * 4 \
        + 131072 * 33


def test_kv_cache_per_token(spec):
    assert mem.kv_cache_bytes_per_token(spec) == 2 * 48 * 4 * 128 * 2 == 98304
    assert mem.kv_cache_bytes_per_token(spec, tp=2) == 2 * 48 * 2 * 128 * 2
    # More TP ranks than KV heads: each rank keeps one (replicated) head.
    assert mem.kv_cache_bytes_per_token(spec, tp=8) == mem.kv_cache_bytes_per_token(spec, tp=4) == 24576


def test_fp32_params_are_their_own_master_copy():
    """fp32 training: 4 (param) + 4 (grad) + 8/d (Adam m, v) bytes; frozen and activations scale too."""
    assert mem.trainable_bytes_per_param(1, param_bytes=4) == 16
    assert mem.trainable_bytes_per_param(8, param_bytes=4) == 8 + 8 / 8
    assert mem.recompute_layer_bytes(2048, 1024, 1, dtype_bytes=4) == 2 * mem.recompute_layer_bytes(2048, 1024, 1)
    assert mem.logits_bytes(1000, 10, 1, dtype_bytes=4) == 10 * 1000 * (4 + 2 * 4) + 10 * 33


def test_activation_dtype_scales_everything_but_fp32_terms(spec):
    shape = mem.LayerShape.from_spec(spec)
    s, b = 4096, 1
    bf16 = mem.layer_activation_bytes(shape, s, b, 4, True, True, 1)
    fp32 = mem.layer_activation_bytes(shape, s, b, 4, True, True, 1, dtype_bytes=4)
    fixed = mem.FP32 * s * b * spec.num_experts / 4 + mem.FP32 * spec.num_attention_heads * s * b / 4  # router, LSE
    assert fp32 - fixed == pytest.approx(2 * (bf16 - fixed))
