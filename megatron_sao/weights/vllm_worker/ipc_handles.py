"""CUDA IPC handles of the trainer's tensors as plain data, both ways (the in-process vLLM on CUDA).

vLLM's ``ipc`` weight-transfer engine opens ``{gpu_uuid: args}`` (packed: one for the bucket's staging
buffer, what the trainer sends; unpacked: one per tensor) where ``args`` is what
``torch.multiprocessing.reductions.reduce_tensor`` returns for a CUDA tensor (the arguments of
``rebuild_cuda_tensor``: tensor and storage classes, a dtype, a ``torch.Size``, stride, the
``cudaIpcMemHandle`` bytes, the producer's ref-counter file and offset, an event handle). Those cross
AsyncLLM's process boundary through vLLM's msgpack encoder, which takes none of the classes, dtypes or
sizes unless ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` lets it pickle (vLLM's own HTTP path pickles them
into ``ipc_handles_pickled`` for the same reason). So the trainer encodes each argument as a tagged
plain value (``encode_ipc_args``), and the worker extension turns them back into the exact tuple vLLM
expects (``decode_update_info``) before it hands the bucket to vLLM's ``Worker.update_weights``.
Only the classes ``reduce_tensor`` uses for a plain tensor are accepted: nothing else is ever
constructed from the message.

Imported inside vLLM worker processes: only the standard library and torch.
"""

from __future__ import annotations

import torch

# The classes reduce_tensor names for a plain (detached, dense) CUDA tensor.
_CLASSES = {"torch.Tensor": torch.Tensor, "torch.storage.TypedStorage": torch.storage.TypedStorage,
            "torch.UntypedStorage": torch.UntypedStorage}
_NAMES = {cls: name for name, cls in _CLASSES.items()}


def _encode(value) -> list:
    if isinstance(value, type):
        if value not in _NAMES:
            raise TypeError(f"CUDA IPC handle: class {value!r} is not one of {sorted(_CLASSES)}")
        return ["class", _NAMES[value]]
    if isinstance(value, torch.dtype):
        return ["dtype", str(value).split(".")[-1]]
    if isinstance(value, torch.Size):
        return ["size", list(value)]
    if isinstance(value, tuple):
        if not all(isinstance(v, int) for v in value):
            raise TypeError(f"CUDA IPC handle: a tuple of ints was expected, got {value!r}")
        return ["ints", list(value)]
    if value is None or isinstance(value, (bool, int, bytes, str)):
        return ["value", value]
    raise TypeError(f"CUDA IPC handle: cannot send a {type(value).__name__} ({value!r}) as plain data")


def _decode(tagged: list):
    tag, value = tagged
    if tag == "class":
        if value not in _CLASSES:
            raise ValueError(f"CUDA IPC handle names class {value!r}, not one of {sorted(_CLASSES)}")
        return _CLASSES[value]
    if tag == "dtype":
        dtype = getattr(torch, value, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"CUDA IPC handle names dtype {value!r}, which torch does not have")
        return dtype
    if tag == "size":
        return torch.Size(value)
    if tag == "ints":
        return tuple(value)
    if tag == "value":
        return value
    raise ValueError(f"CUDA IPC handle: unknown tag {tag!r}")


def encode_ipc_args(args: tuple) -> list[list]:
    """``reduce_tensor(t)[1]`` (the arguments of ``rebuild_cuda_tensor``) as tagged plain values."""
    return [_encode(a) for a in args]


def decode_ipc_args(encoded: list[list]) -> tuple:
    """The exact tuple ``encode_ipc_args`` was given."""
    return tuple(_decode(a) for a in encoded)


def decode_update_info(update_info: dict) -> dict:
    """vLLM's ``IPCWeightTransferUpdateInfo`` fields from what the trainer sent: the same names, dtypes,
    shapes (and ``tensor_sizes``), and ``ipc_handles`` back to vLLM's form: packed (what the trainer
    sends, ``weights/inprocess_transports.py``), one ``{gpu_uuid: encoded args}`` for the bucket's
    buffer becomes ``{gpu_uuid: args}``; unpacked, a list of them, one per tensor."""
    handles = update_info.get("ipc_handles")
    if isinstance(handles, dict):
        return {**update_info, "ipc_handles": {uuid: decode_ipc_args(args) for uuid, args in handles.items()}}
    if not isinstance(handles, list):
        raise ValueError("CUDA IPC update_info needs 'ipc_handles': {gpu_uuid: args} of the bucket's buffer "
                         "(packed), or one per tensor")
    return {**update_info, "ipc_handles": [{uuid: decode_ipc_args(args) for uuid, args in h.items()}
                                           for h in handles]}
