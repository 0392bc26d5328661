"""Canonical Megatron-Core parameter names, independent of the layer spec.

The local spec and the TransformerEngine spec name the same weights differently:

| canonical (local spec)                                | TE spec                                          |
| ----------------------------------------------------- | ------------------------------------------------ |
| decoder.layers.N.input_layernorm.weight              | decoder.layers.N.self_attention.linear_qkv.layer_norm_weight |
| decoder.layers.N.pre_mlp_layernorm.weight (dense)    | decoder.layers.N.mlp.linear_fc1.layer_norm_weight |
| decoder.layers.N.mlp.experts.local_experts.E.linear_fcK.weight | decoder.layers.N.mlp.experts.linear_fcK.weightE (grouped GEMM) |

All mapping, sharding and checkpoint code works on canonical names; `canonical_name` is the one
place that knows the TE spellings. Names keep their *local* indices (layer within the PP stage,
expert within the EP rank); `sharding.local_to_global_name` adds the offsets.
"""  # noqa: E501 (a markdown table row above cannot be broken)

from __future__ import annotations

import re

_RULES: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"\.self_attention\.linear_qkv\.layer_norm_weight$"), ".input_layernorm.weight"),
    (re.compile(r"\.mlp\.linear_fc1\.layer_norm_weight$"), ".pre_mlp_layernorm.weight"),
    (re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$"), r".mlp.experts.local_experts.\2.\1.weight"),
)
_WRAPPER_PREFIX = re.compile(r"^(module\.)+")


def canonical_name(name: str) -> str:
    """Canonical (local-spec) spelling of a Megatron parameter name; strips DDP `module.` prefixes."""
    name = _WRAPPER_PREFIX.sub("", name)
    for pattern, repl in _RULES:
        name = pattern.sub(repl, name)
    return name


def is_extra_state(name: str) -> bool:
    """TE/fp8 bookkeeping entries in state dicts that are not weights."""
    return name.endswith("_extra_state")
