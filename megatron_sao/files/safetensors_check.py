"""Say what is wrong with a safetensors file that the library refuses, naming the file and the tensor.

safetensors reports a truncated file as "incomplete metadata, file not fully covered" without the
file's name or which tensors are cut off. `open_safetensors` wraps `safe_open` and, when it fails,
reads the header itself (8-byte little-endian length, JSON, data section) to explain the failure.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from megatron_sao.errors import UserError


class SafetensorsFileError(UserError):
    """A safetensors file that cannot be read; the message names the file (and the tensor)."""


def diagnose(path: str | os.PathLike) -> str:
    """A one-line explanation of why `path` is not a complete safetensors file."""
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{p}: truncated to {size} bytes, shorter than the 8-byte header length"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return f"{p}: truncated: the header needs {n} bytes, the file has {size - 8} after the length"
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            return f"{p}: the header is not valid JSON ({e})"
    data = size - 8 - n
    cut = [(name, h["data_offsets"]) for name, h in header.items()
           if name != "__metadata__" and isinstance(h, dict) and h.get("data_offsets", [0, 0])[1] > data]
    if cut:
        name, (a, b) = min(cut, key=lambda x: x[1][0])
        return (f"{p}: truncated: tensor {name!r} needs bytes [{a}, {b}) of the data section, the file holds "
                f"{data} ({len(cut)} tensor(s) cut off)")
    return f"{p}: not a valid safetensors file"


def open_safetensors(path: str | os.PathLike, framework: str = "pt"):
    """`safe_open`, but a damaged file raises SafetensorsFileError naming the file and the tensor."""
    from safetensors import safe_open

    if not Path(path).is_file():
        raise SafetensorsFileError(f"{path}: no such file")
    try:
        return safe_open(os.fspath(path), framework)
    except Exception as e:  # SafetensorError has no importable base class across versions
        if type(e).__name__ != "SafetensorError":
            raise
        raise SafetensorsFileError(f"{diagnose(path)} ({e})") from None
