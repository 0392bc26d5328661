"""The critic's "attention" freeze preset follows the model: no q/k-norm patterns for Llama.

Regression: `sao train` on SmolLM2-135M (Llama, no q/k norms) failed in build_critic with
"freeze pattern(s) matched no parameter on any rank: [...q_layernorm.weight, ...k_layernorm.weight]".
"""

from megatron_sao.config import CriticConfig
from megatron_sao.models.freeze import CRITIC_FROZEN_ATTENTION
from megatron_sao.models.hf_config import model_spec_from_hf
from megatron_sao.models.presets import tiny_hf_config
from megatron_sao.trainer.components import critic_freeze_patterns


def test_llama_attention_preset_has_no_qk_norm_patterns():
    spec = model_spec_from_hf(tiny_hf_config("llama"))
    pats = critic_freeze_patterns(CriticConfig(freeze=["attention", "value_head*"]), spec)
    assert not any("q_layernorm" in p or "k_layernorm" in p for p in pats)
    assert "decoder.layers.*.self_attention.linear_qkv.weight" in pats and pats[-1] == "value_head*"


def test_qk_norm_models_keep_the_full_preset():
    spec = model_spec_from_hf(tiny_hf_config("qwen3_moe"))
    assert critic_freeze_patterns(CriticConfig(freeze=["attention"]), spec) == list(CRITIC_FROZEN_ATTENTION)
    assert critic_freeze_patterns(CriticConfig(freeze=[]), spec) == []
