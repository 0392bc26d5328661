"""HF configs for tests and examples: tiny random models and the Qwen3-30B-A3B flagship."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from megatron_sao.models.hf_config import load_hf_config

_CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")

_COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
               rms_norm_eps=1e-6, max_position_embeddings=256, attention_bias=False, initializer_range=0.02,
               bos_token_id=1, eos_token_id=2)  # no pad_token_id: HF would zero its embedding grad (padding_idx)

# Choices that exercise different code paths: Qwen3-MoE untied with renormalised top-k (the
# flagship's settings); Qwen3 dense with TIED embeddings; Llama (no q/k norm) untied, 3 layers.
_TINY: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(_COMMON, vocab_size=128, num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=32,
                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[], tie_word_embeddings=False, router_aux_loss_coef=0.0,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen3": dict(_COMMON, vocab_size=160, num_hidden_layers=2, intermediate_size=96, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "llama": dict(_COMMON, vocab_size=192, num_hidden_layers=4, intermediate_size=128, tie_word_embeddings=False,
                  mlp_bias=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
}

_ARCH_CLASS = {"qwen3_moe": ["Qwen3MoeForCausalLM"], "qwen3": ["Qwen3ForCausalLM"], "llama": ["LlamaForCausalLM"]}


def tiny_hf_config(arch: str, *, for_vllm: bool = False, **overrides: Any) -> PretrainedConfig:
    """A tiny HF config of `arch` ("qwen3_moe", "qwen3", "llama").

    for_vllm=True uses head_dim 32 (vLLM's CPU attention has no head_dim 16 kernel).
    `overrides` are HF config fields.
    """
    if arch not in _TINY:
        raise ValueError(f"no tiny preset for arch {arch!r}; have {sorted(_TINY)}")
    fields = dict(_TINY[arch])
    if for_vllm:
        fields["head_dim"] = 32
    fields.update(overrides)
    fields["model_type"] = arch
    fields.setdefault("dtype", "float32")
    cfg = load_hf_config(fields)
    cfg.architectures = list(_ARCH_CLASS[arch])
    return cfg


def tiny_hf_model(config: PretrainedConfig, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random HF causal LM for `config`, in eval mode, with weights spread for testing.

    Norm weights ~ 1 + 0.1 N(0,1) (ones would hide a swapped norm), router weights 0.5 N(0,1) so
    that top-k routing has clear margins (near-ties flip experts under float round-off and make an
    exact-logits comparison flaky), everything else 0.08 N(0,1).
    """
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.08 * torch.randn(param.shape, generator=gen))
    return model


def qwen3_30b_a3b_config() -> PretrainedConfig:
    """Qwen/Qwen3-30B-A3B's config.json (packaged copy, megatron_sao/models/configs/)."""
    with open(os.path.join(_CONFIG_DIR, "qwen3_30b_a3b.json")) as f:
        return load_hf_config(json.load(f))
