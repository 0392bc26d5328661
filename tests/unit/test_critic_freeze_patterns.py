"""The critic's freeze groups follow the model (no q/k-norm patterns for Llama, no router for a dense
model) and name the same tensors under the local and the TransformerEngine layer spec.

Regression: `sao train` on SmolLM2-135M (Llama, no q/k norms) failed in build_critic with
"freeze pattern(s) matched no parameter on any rank: [...q_layernorm.weight, ...k_layernorm.weight]".
"""

import fnmatch

from megatron_sao.checkpoint.param_counts import param_group
from megatron_sao.config import PAPER_CRITIC_FREEZE, CriticConfig
from megatron_sao.models.freeze import CRITIC_FROZEN_ATTENTION
from megatron_sao.models.hf_config import model_spec_from_hf
from megatron_sao.models.names import canonical_name
from megatron_sao.models.presets import tiny_hf_config
from megatron_sao.trainer.components import critic_freeze_patterns


def test_llama_attention_preset_has_no_qk_norm_patterns():
    spec = model_spec_from_hf(tiny_hf_config("llama"))
    pats = critic_freeze_patterns(CriticConfig(freeze=["attention", "value_head*"]), spec)
    assert not any("q_layernorm" in p or "k_layernorm" in p for p in pats)
    assert "decoder.layers.*.self_attention.linear_qkv.weight" in pats and pats[-1] == "value_head*"


def test_qk_norm_models_keep_the_full_attention_group():
    spec = model_spec_from_hf(tiny_hf_config("qwen3_moe"))
    assert critic_freeze_patterns(CriticConfig(freeze=["attention"]), spec) == list(CRITIC_FROZEN_ATTENTION)
    assert critic_freeze_patterns(CriticConfig(freeze=[]), spec) == []


def test_paper_preset_on_a_dense_model_has_no_router_pattern():
    spec = model_spec_from_hf(tiny_hf_config("qwen3"))
    pats = critic_freeze_patterns(CriticConfig(freeze=list(PAPER_CRITIC_FREEZE)), spec)
    assert "embedding.word_embeddings.weight" in pats and "decoder.final_layernorm.weight" in pats
    assert not any("router" in p for p in pats)


# The TransformerEngine spec fuses norms into the next linear and groups the experts (GPU runs).
TE_NAMES = {
    "module.decoder.layers.3.self_attention.linear_qkv.layer_norm_weight": ("attention", True),
    "module.decoder.layers.3.mlp.linear_fc1.layer_norm_weight": ("norms", True),  # dense pre-MLP norm
    "module.decoder.layers.3.pre_mlp_layernorm.weight": ("norms", True),  # MoE layer: a separate norm
    "module.decoder.layers.3.mlp.router.weight": ("router", True),
    "module.decoder.layers.3.mlp.experts.linear_fc1.weight7": ("experts", False),
    "module.decoder.layers.3.mlp.linear_fc2.weight": ("mlp", False),
    "module.embedding.word_embeddings.weight": ("embeddings", True),
    "module.value_head.weight": ("value_head", False),
}


def test_groups_and_default_freeze_see_te_names_as_local_ones():
    spec = model_spec_from_hf(tiny_hf_config("qwen3_moe"))
    pats = critic_freeze_patterns(CriticConfig(freeze=list(PAPER_CRITIC_FREEZE)), spec)
    for name, (group, frozen) in TE_NAMES.items():
        assert param_group(name) == group, name
        assert any(fnmatch.fnmatchcase(canonical_name(name), p) for p in pats) == frozen, name
