"""Which Megatron layer spec to build: TransformerEngine on CUDA, the local spec otherwise.

The local spec is Megatron's pure-PyTorch implementation (DotProductAttention, ColumnParallel/
RowParallelLinear, SequentialMLP experts). It is what runs on a CPU (no TE, no CUDA) and what the
exact-logits tests check. Two parts are swapped: every norm for `SPRMSNorm` (`WrappedTorchNorm` refuses
sequence parallel; same math, same parameter name `weight`), and the core attention for `SDPAttention`
(models/sdpa_attention.py: torch's fused causal attention kernel instead of Megatron's spelled-out
baddbmm / masked softmax / bmm; same math, no parameters).

Parameter names differ between the two specs (TE folds the input norm into linear_qkv and uses
grouped-GEMM expert weights); `megatron_sao.models.names.canonical_name` maps both to one
naming, so nothing else needs to know which spec was built.
"""

from __future__ import annotations

import copy
import importlib.util

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_sao.models.norms import SPRMSNorm
from megatron_sao.models.sdpa_attention import SDPAttention


def transformer_engine_usable() -> bool:
    """True when TransformerEngine is importable and a CUDA device exists."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def _local_layer_spec(layer_spec, qk_layernorm: bool):
    """A copy of one local layer spec with every norm replaced by `SPRMSNorm` (q/k norms only when the
    model has them: otherwise the spec holds IdentityOp there, which must stay) and the core attention
    by `SDPAttention`."""
    layer_spec = copy.deepcopy(layer_spec)
    sub = layer_spec.submodules
    sub.input_layernorm = SPRMSNorm
    sub.pre_mlp_layernorm = SPRMSNorm
    attn_sub = sub.self_attention.submodules
    attn_sub.core_attention = SDPAttention
    if qk_layernorm:
        attn_sub.q_layernorm = SPRMSNorm
        attn_sub.k_layernorm = SPRMSNorm
    return layer_spec


def decoder_block_spec(config: TransformerConfig, *, use_te: bool,
                       vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """Block spec (the layers of this pipeline stage + final norm) for a GPT decoder."""
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm",
                                       vp_stage=vp_stage)
    if use_te:
        return block
    # get_gpt_decoder_block_spec repeats one spec object per layer: convert each distinct one once.
    converted: dict[int, object] = {}
    layers = []
    for spec in block.layer_specs:
        if id(spec) not in converted:
            converted[id(spec)] = _local_layer_spec(spec, config.qk_layernorm)
        layers.append(converted[id(spec)])
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=SPRMSNorm)
