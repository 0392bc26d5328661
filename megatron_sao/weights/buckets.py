"""What moves: a bucket of full HF-named tensors, its size, its two wire forms, and the transport names.

A bucket is the unit every stage of a weight update handles: the export yields one when the next
tensor would overflow ``bucket_bytes``, the sync sends it to every engine before the next is asked
for, and a transport moves it either by broadcast (``bucket_update_info``: what a receiver needs to
allocate the tensors) or as safetensors bytes (``serialize_bucket``: plain bytes cross a process
boundary without pickling).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    import torch

# torch-free at import (the config tree imports the transport names from here).
WeightBucket = list[tuple[str, "torch.Tensor"]]

# How an engine takes an update: ``auto`` lets the engine choose (CUDA IPC or NCCL on a GPU, the gloo
# group on CPU); ``reload`` is safetensors bytes through vLLM's reload. The config validates against
# this one list.
WeightTransportName = Literal["auto", "reload", "nccl", "gloo"]
WEIGHT_TRANSPORTS: tuple[str, ...] = get_args(WeightTransportName)


def bucket_bytes(bucket: WeightBucket) -> int:
    """Payload of one bucket in bytes."""
    return sum(t.numel() * t.element_size() for _, t in bucket)


def bucket_update_info(bucket: WeightBucket) -> dict:
    """What vLLM's update_weights needs to receive one bucket by broadcast (names, dtypes, shapes)."""
    return {"names": [n for n, _ in bucket], "dtype_names": [str(t.dtype).split(".")[-1] for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket]}


def serialize_bucket(bucket: WeightBucket) -> bytes:
    """One bucket as safetensors bytes (contiguous detached CPU copies: safetensors refuses views)."""
    from safetensors.torch import save

    return save({n: t.detach().to("cpu").contiguous() for n, t in bucket})
