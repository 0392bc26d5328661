"""MoE routes as the engines return them (routing replay): decoding and the expert count.

vLLM 0.32 returns a completion's routed experts as a numpy array [tokens, layers, topk]
(``CompletionOutput.routed_experts``); its HTTP routes (``/inference/v1/generate`` and
``/v1/completions``) send the same array base64-encoded in ``.npy`` format. The tokens are the prompt's
from ``routed_experts_prompt_start`` on and every sampled token but the last (no forward sees it).
Both become the smallest integer tensor that holds the model's expert count (`trajectory.route_dtype`).
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import torch

from megatron_sao.trajectory import route_dtype


def num_experts_of(model_path: str) -> int:
    """The expert count in an HF config.json (0 for a dense model)."""
    with open(Path(model_path) / "config.json") as f:
        hf = json.load(f)
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def routes_tensor(routes: np.ndarray | None, num_experts: int, where: str) -> torch.Tensor:
    """[tokens, layers, topk] expert ids, checked against the expert count, in route_dtype(num_experts)."""
    if routes is None:
        raise RuntimeError(f"{where}: routes were asked for and none came back (is the engine started with "
                           "enable_return_routed_experts?)")
    t = torch.as_tensor(np.asarray(routes)).to(torch.int64)
    if t.dim() != 3:
        raise RuntimeError(f"{where}: routed_experts has shape {tuple(t.shape)}, expected [tokens, layers, topk]")
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_experts):
        raise RuntimeError(f"{where}: routed_experts names experts outside 0..{num_experts - 1}")
    return t.to(route_dtype(num_experts))


def decode_b64_routes(data: str | None, num_experts: int, where: str) -> torch.Tensor:
    """A server's base64 ``.npy`` routed_experts (``np.load(io.BytesIO(base64.b64decode(s)))``)."""
    if data is None:
        return routes_tensor(None, num_experts, where)
    try:
        array = np.load(io.BytesIO(base64.b64decode(data)), allow_pickle=False)
    except (ValueError, OSError) as e:
        raise RuntimeError(f"{where}: routed_experts is not a base64 .npy array ({e})") from None
    return routes_tensor(array, num_experts, where)


def packed_routes(routes: np.ndarray | None, num_experts: int, where: str) -> tuple:
    """routed_experts as (shape, dtype name, bytes): compact, picklable, and comparable with == (the colocated
    leader checks that an engine's ranks finished the same requests; tensors do not compare that way)."""
    t = routes_tensor(routes, num_experts, where)
    return tuple(t.shape), str(t.dtype).removeprefix("torch."), t.numpy().tobytes()


def unpacked_routes(packed: tuple | None) -> torch.Tensor | None:
    if packed is None:
        return None
    shape, dtype, data = packed
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).reshape(shape)


def scored_routes(routes: torch.Tensor, n_tokens: int, where: str,
                  error: type[Exception] = RuntimeError) -> torch.Tensor:
    """The routes of a scored prompt (``routed_experts_prompt_start`` 0): one per token, or ``error``."""
    if routes.shape[0] != n_tokens:
        raise error(f"{where}: routed_experts of a scored prompt cover {routes.shape[0]} tokens, expected {n_tokens}")
    return routes
