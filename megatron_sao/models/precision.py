"""Training precision and the attention kernel it allows: one answer for the trainer and `sao plan`.

`model.dtype` names the dtype the Megatron models are built in (TransformerConfig.params_dtype).
With bfloat16, Megatron's mixed precision applies: the optimizer keeps fp32 main parameters, Adam
moments and gradients (DDP grad_reduce_in_fp32), and the bf16 weights are copied from the fp32 main
ones after every step. float32 builds everything in fp32 (the CPU demo and the exact-logits tests:
bf16 matmuls are slow on most CPUs).

The dtype also decides the attention kernel. TransformerEngine's fused (cuDNN) attention only takes
fp16/bf16 inputs; with fp32 TE falls back to unfused attention, which materialises the s x s score
matrix (16 GiB per head-batch at 64K tokens), and so does Megatron's local (non-TE) spec. The
planner counts that term exactly when `attention_kernel` says "unfused", so a plan and a run agree.

Pure Python (torch imported lazily) so that `sao plan` stays light.
"""

from __future__ import annotations

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TRAINABLE_DTYPES = ("float32", "bfloat16")  # float16 would need loss scaling, which the trainer has not
FUSED, UNFUSED = "fused", "unfused"


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a `model.dtype` name."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"model.dtype: {dtype!r} is not one of {sorted(DTYPE_BYTES)}") from None


def training_dtype(dtype: str):
    """torch dtype the trainer builds its models in for `model.dtype`; ValueError names the key."""
    import torch

    if dtype not in TRAINABLE_DTYPES:
        raise ValueError(f"model.dtype: the trainer builds models in one of {list(TRAINABLE_DTYPES)}, got {dtype!r} "
                         "(float16 training needs loss scaling, which is not implemented; use bfloat16)")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def attention_kernel(dtype: str, use_te: bool) -> str:
    """"fused" (TE's cuDNN fused attention: no s x s matrix) or "unfused" (s x s scores are stored)."""
    dtype_bytes(dtype)
    return FUSED if use_te and dtype in ("bfloat16", "float16") else UNFUSED
