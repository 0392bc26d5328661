"""The compute a row of a batch costs, for balancing rows over data-parallel ranks.

A row of `s` tokens costs matmul FLOPs linear in `s` (every projection, the active experts, the
LM head) plus the attention scores and their product with V, quadratic in `s`. Per token, forward:

    linear    = 2 * (active matmul parameters per token)
    attention = 2 * 2 * s * heads * head_dim per layer for a full s x s score matrix, halved by
                causality: 2 * s * heads * head_dim * layers

so cost(s) = s + a * s^2 with a = (2 * layers * heads * head_dim) / linear, in units of one token's
linear FLOPs. The backward pass and a full recompute multiply both terms by about the same factor,
so `a` holds for the whole train step. Qwen3-30B-A3B: linear = 2 * 3.04e9 (attention projections
18.9M + 8 experts 37.7M + router 0.26M per layer, x48, + the 311M LM head), attention per token^2 =
393216, so a = 6.5e-5: attention equals the linear part at about 15K tokens and is 8.5x it at 128K.
verl's `calculate_workload` uses the same form with a constant fitted to a 7B dense model.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_sao.models.hf_config import ModelSpec


def linear_flops_per_token(spec: ModelSpec) -> float:
    """Forward matmul FLOPs of one token outside attention's s x s part (2 per active weight)."""
    h, hd = spec.hidden_size, spec.head_dim
    qkv = h * hd * (spec.num_attention_heads + 2 * spec.num_kv_heads)
    out = spec.num_attention_heads * hd * h
    if spec.is_moe:
        mlp = spec.moe_topk * 3 * h * spec.moe_ffn_hidden_size + h * spec.num_experts  # experts + router
    else:
        mlp = 3 * h * spec.ffn_hidden_size  # gate, up, down
    return 2.0 * (spec.num_layers * (qkv + out + mlp) + h * spec.vocab_size)


def attention_flops_per_token_sq(spec: ModelSpec) -> float:
    """Forward FLOPs of causal attention per s^2 (QK^T and PV over all layers, half the matrix)."""
    return 2.0 * spec.num_layers * spec.num_attention_heads * spec.head_dim


@dataclass(frozen=True)
class CostModel:
    """cost(s) = s + attention_coeff * s^2 (one token's linear FLOPs as the unit)."""

    attention_coeff: float

    @classmethod
    def for_model(cls, spec: ModelSpec) -> "CostModel":
        return cls(attention_flops_per_token_sq(spec) / linear_flops_per_token(spec))

    def row(self, length: int) -> float:
        return float(length) + self.attention_coeff * float(length) ** 2

    def padded(self, height: int, width: int) -> float:
        """Cost of a [height, width] micro-batch: every row, padding or not, is computed at full width."""
        return height * self.row(width)
