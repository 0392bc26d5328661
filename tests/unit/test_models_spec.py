"""ModelSpec, ParallelSizes, names and sharding rules (no processes, no Megatron model)."""

from __future__ import annotations

import pytest
import torch

from megatron_sao.checkpoint.param_layout import full_param_shapes
from megatron_sao.checkpoint.sharding import (
    RankLayout,
    global_to_local_name,
    local_to_global_name,
    shard_tensor,
    tp_partition,
    unshard_tensor,
)
from megatron_sao.models.hf_config import ModelSpec, model_spec_from_hf
from megatron_sao.models.names import canonical_name
from megatron_sao.models.parallel_sizes import ParallelSizes
from megatron_sao.models.presets import qwen3_30b_a3b_config, tiny_hf_config
from megatron_sao.models.vocab import padded_vocab_size


def test_qwen3_30b_a3b_spec():
    spec = model_spec_from_hf(qwen3_30b_a3b_config())
    assert (spec.hidden_size, spec.num_layers, spec.num_attention_heads, spec.num_kv_heads, spec.head_dim) == \
        (2048, 48, 32, 4, 128)
    assert (spec.num_experts, spec.moe_topk, spec.moe_ffn_hidden_size, spec.vocab_size) == (128, 8, 768, 151936)
    assert spec.norm_topk_prob and not spec.tie_word_embeddings and spec.rope_theta == 1e6 and spec.qk_layernorm
    total = sum(torch.Size(s).numel() for s in full_param_shapes(spec, "actor").values())
    assert 30.4e9 < total < 30.6e9  # 30.5B parameters
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    ParallelSizes(tp=4, pp=2, ep=8, etp=1, sequence_parallel=True).validate_for(spec, world_size=64)


@pytest.mark.parametrize("overrides,field", [
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}}, "rope_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
])
def test_unsupported_config_fields_are_named(overrides, field):
    arch = "qwen3_moe" if field == "mlp_only_layers" else "llama"
    with pytest.raises(ValueError, match=field):
        model_spec_from_hf(tiny_hf_config(arch, **overrides))


def test_unsupported_arch_and_parallel_sizes():
    with pytest.raises(ValueError, match="gpt2"):
        model_spec_from_hf({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="sequence_parallel"):
        ParallelSizes(sequence_parallel=True)
    with pytest.raises(ValueError, match="tp"):
        ParallelSizes(tp=0)
    spec = model_spec_from_hf(tiny_hf_config("qwen3_moe"))
    with pytest.raises(ValueError, match="num_experts"):
        ParallelSizes(ep=3).validate_for(spec)
    with pytest.raises(ValueError, match="dense"):
        ParallelSizes(ep=2).validate_for(model_spec_from_hf(tiny_hf_config("llama")))
    with pytest.raises(ValueError, match="expert grid"):
        ParallelSizes(tp=2, ep=2, etp=2, sequence_parallel=True).validate_for(spec, world_size=2)  # needs etp=1
    ParallelSizes(tp=2, ep=2, sequence_parallel=True).validate_for(spec, world_size=2)  # the default rule: etp=1


def test_canonical_names_fold_te_spellings():
    assert canonical_name("module.decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.3.input_layernorm.weight"
    assert canonical_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.0.pre_mlp_layernorm.weight"
    assert canonical_name("decoder.layers.1.mlp.experts.linear_fc2.weight7") == \
        "decoder.layers.1.mlp.experts.local_experts.7.linear_fc2.weight"


def test_local_global_names_pp_ep():
    spec = model_spec_from_hf(tiny_hf_config("qwen3_moe", num_hidden_layers=4, num_experts=8))
    lay = RankLayout(pp=2, pp_rank=1, ep=2, ep_rank=1)
    local = "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"
    glob = "decoder.layers.3.mlp.experts.local_experts.6.linear_fc1.weight"
    assert local_to_global_name(local, lay, spec) == glob and global_to_local_name(glob, lay, spec) == local
    assert global_to_local_name("decoder.layers.1.input_layernorm.weight", lay, spec) is None
    assert global_to_local_name("decoder.layers.3.mlp.experts.local_experts.1.linear_fc2.weight", lay, spec) is None
    assert global_to_local_name("embedding.word_embeddings.weight", lay, spec) is None
    assert global_to_local_name("output_layer.weight", lay, spec) == "output_layer.weight"
    with pytest.raises(ValueError, match="not a Megatron"):
        global_to_local_name("model.norm.weight", lay, spec)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3", "llama"])
def test_shard_unshard_inverse_for_every_param(arch):
    spec = model_spec_from_hf(tiny_hf_config(arch))
    gen = torch.Generator().manual_seed(0)
    for name, shape in full_param_shapes(spec, "actor").items():
        full = torch.randn(shape, generator=gen)
        shards = [shard_tensor(name, full, RankLayout(tp=2, tp_rank=r), spec) for r in range(2)]
        assert torch.equal(unshard_tensor(name, shards, spec), full), name
        split = tp_partition(name, spec)
        if split.vocab:  # padded to a multiple of 128 * tp (Megatron-LM's rule), stripped by unshard
            assert shards[0].shape[0] == padded_vocab_size(spec.vocab_size, 2) // 2, name
            assert not shards[1][-(padded_vocab_size(spec.vocab_size, 2) - spec.vocab_size):].any(), name
        elif split.dim is not None:
            assert shards[0].numel() * 2 == full.numel(), name
    fc1 = torch.arange(8.0)[:, None]  # [gate(4); up(4)] -> rank 1: [gate[2:4]; up[2:4]]
    spec_ = spec
    got = shard_tensor("decoder.layers.0.mlp.linear_fc1.weight", fc1, RankLayout(tp=2, tp_rank=1), spec_)
    assert got.flatten().tolist() == [2.0, 3.0, 6.0, 7.0]


def test_shard_error_names_tensor():
    spec = model_spec_from_hf(tiny_hf_config("llama"))
    with pytest.raises(ValueError, match="linear_proj"):
        shard_tensor("decoder.layers.0.self_attention.linear_proj.weight", torch.zeros(64, 63),
                     RankLayout(tp=2, tp_rank=0), spec)


def test_padded_vocab_size_is_megatron_lms_rule():
    """ceil(V / (128 * tp)) * 128 * tp, Megatron-LM's _vocab_size_with_padding with the default
    make_vocab_size_divisible_by=128."""
    assert [padded_vocab_size(50257, tp) for tp in (1, 2, 4, 8)] == [50304, 50432, 50688, 51200]
    assert padded_vocab_size(151936, 4) == 152064 and padded_vocab_size(128, 1) == 128
    assert padded_vocab_size(128, 2) == 256  # TP rank 1 then holds padding only
    with pytest.raises(ValueError, match="vocab_size"):
        padded_vocab_size(0, 2)


def test_vocab_not_divisible_by_tp_is_no_longer_refused():
    spec = model_spec_from_hf(tiny_hf_config("llama", vocab_size=50257, num_key_value_heads=4))
    assert ParallelSizes(tp=4).problems(spec, world_size=4) == []
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(50257, 64, generator=gen)
    shards = [shard_tensor("output_layer.weight", full, RankLayout(tp=4, tp_rank=r), spec) for r in range(4)]
    assert [s.shape[0] for s in shards] == [12672] * 4 and not shards[3][50257 - 3 * 12672:].any()
    assert torch.equal(unshard_tensor("output_layer.weight", shards, spec), full)
    one = shard_tensor("embedding.word_embeddings.weight", full, RankLayout(), spec)  # TP 1 pads too
    assert one.shape[0] == 50304 and torch.equal(unshard_tensor("embedding.word_embeddings.weight", [one], spec), full)


def test_default_expert_tp_rule():
    from megatron_sao.models.parallel_sizes import default_expert_tp

    assert [default_expert_tp(tp, ep) for tp, ep in [(4, 32), (2, 32), (1, 1), (2, 2), (2, 1), (4, 2)]] == \
        [1, 1, 1, 1, 2, 4]
    assert ParallelSizes(tp=4, ep=32, sequence_parallel=True).expert_tp == 1
    assert ParallelSizes(tp=4, ep=32, etp=4, sequence_parallel=True).expert_tp == 4  # explicit wins
    # RankLayout (checkpoint sharding) follows the same rule when etp is not given.
    assert RankLayout(tp=2, tp_rank=1, ep=2, ep_rank=0).expert_tp == 1
    assert RankLayout(tp=2, tp_rank=1).expert_tp == 2


def test_precision_names_kernel_and_refuses_fp16():
    from megatron_sao.models.precision import attention_kernel, training_dtype

    assert training_dtype("bfloat16") == torch.bfloat16 and training_dtype("float32") == torch.float32
    with pytest.raises(ValueError, match="model.dtype"):
        training_dtype("float16")
    assert attention_kernel("bfloat16", use_te=True) == "fused"
    assert attention_kernel("float32", use_te=True) == "unfused"  # TE's fused attention takes fp16/bf16 only
    assert attention_kernel("bfloat16", use_te=False) == "unfused"  # the local spec materialises s x s


def test_trainer_kwargs_on_a_gpu_node():
    """What a TE node builds (the TransformerConfig cannot be constructed without TE here, its fields can)."""
    from megatron.core.transformer.enums import AttnBackend

    from megatron_sao.models.gpt import transformer_config_kwargs

    spec = model_spec_from_hf(tiny_hf_config("qwen3_moe"))
    bf16 = transformer_config_kwargs(spec, ParallelSizes(), params_dtype=torch.bfloat16, use_te=True)
    assert bf16["attention_backend"] == AttnBackend.fused and bf16["bf16"] and bf16["params_dtype"] == torch.bfloat16
    fp32 = transformer_config_kwargs(spec, ParallelSizes(), params_dtype=torch.float32, use_te=True)
    assert fp32["attention_backend"] == AttnBackend.unfused and not fp32["bf16"]
    cpu = transformer_config_kwargs(spec, ParallelSizes(), params_dtype=torch.bfloat16, use_te=False)
    assert cpu["attention_backend"] == AttnBackend.local
