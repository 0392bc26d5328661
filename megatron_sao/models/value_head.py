"""Scalar value head that stands in for the critic's vocabulary projection.

The critic is the actor's backbone with `output_layer` ([V/TP, H], column-parallel) replaced by
a replicated [1, H] projection plus a scalar bias (HF token-classification critics, e.g.
verl's AutoModelForTokenClassification(num_labels=1), have `score.weight` and `score.bias`). It keeps
the call signature of `ColumnParallelLinear` so that `GPTModel._postprocess` runs unchanged and
returns values [B, S, 1] where the actor returns logits [B, S, V/TP].

Why replicated and not column-parallel: one output column cannot be split across TP ranks. Every
TP rank computes the same values from the same full-sequence hidden states, so the weight's
gradient is identical on all TP ranks and needs no TP all-reduce (like any replicated param,
Megatron's grad-norm counts it on TP rank 0 only).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.transformer_config import TransformerConfig

VALUE_HEAD_INITS = ("normal", "zero")
# Same seed on every rank, so the replicated weight starts identical across TP/DP ranks without
# a broadcast (in practice the critic is loaded from a checkpoint or an HF model anyway).
_VALUE_HEAD_SEED = 20250711


class ValueHead(torch.nn.Module):
    """[S(/TP under SP), B, H] hidden states -> ([S, B, 1] values, None)."""

    def __init__(self, config: TransformerConfig, init: str = "zero", tp_group=None) -> None:
        super().__init__()
        if init not in VALUE_HEAD_INITS:
            raise ValueError(f"value_head_init must be one of {VALUE_HEAD_INITS}, got {init!r}")
        self.sequence_parallel = config.sequence_parallel
        self.tp_group = tp_group
        weight = torch.zeros(1, config.hidden_size, dtype=config.params_dtype)
        if init == "normal":
            gen = torch.Generator().manual_seed(_VALUE_HEAD_SEED)
            weight.copy_(torch.randn(1, config.hidden_size, generator=gen) * config.init_method_std)
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        self.weight = torch.nn.Parameter(weight.to(device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype, device=device))

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        if weight is not None:
            raise ValueError("ValueHead cannot share weights with the embedding (critic must not tie embeddings)")
        if self.sequence_parallel:
            group = self.tp_group or parallel_state.get_tensor_model_parallel_group()
            # tensor_parallel_output_grad=False: the backward *splits* the (identical, full)
            # gradient instead of reduce-scattering it, which would multiply it by TP.
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=group)
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None
