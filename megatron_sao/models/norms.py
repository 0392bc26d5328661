"""RMSNorm for the local (non-TransformerEngine) layer spec that also works with sequence parallel.

Megatron's `WrappedTorchNorm` asserts `not config.sequence_parallel`, and TE's fused norm needs
CUDA, so the CPU path has no norm that runs under TP + sequence parallel. Under SP every TP rank
normalises a different slice of the sequence, so the norm weight's gradient is a partial sum:
tagging the weight `sequence_parallel=True` makes `finalize_model_grads` all-reduce it over the
TP group, exactly as Megatron does for its own SP-aware norms.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class SPRMSNorm(torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` with the constructor signature Megatron's `build_module` uses."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        # Built directly in params_dtype; use_cpu_initialization is irrelevant (weight starts at ones).
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        if config.sequence_parallel:
            setattr(self.weight, "sequence_parallel", True)
