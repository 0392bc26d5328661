"""The trainer <-> rollout-server weight-transfer group: rendezvous arithmetic and the data plane.

One group for every server in an update (``weights/server_group.py`` forms it): the trainer's
global rank 0 is rank 0, server ``j``'s TP*PP workers are ranks ``rank_offset_j + worker_rank``
(vLLM's rule, ``nccl_common.worker_init_process_group``), with offsets 1, 1 + tp_0, ..., so the world
is ``1 + sum(tp_j * pp_j)``. The rendezvous is vLLM's ``StatelessProcessGroup`` (a TCPStore that rank 0
hosts at ``master_address:master_port``): the address must be the trainer rank-0 host as the servers
see it. A single server alone (a client used without the shared group) is the same with one member.

Only the data plane differs between the GPU and the CPU build:

* ``"nccl"`` (GPU): vLLM's own ``PyNcclCommunicator`` on top of the store (``trainer_init`` on our
  side, vLLM's ``NCCLWeightTransferEngine`` on the server's);
* ``"gloo"`` (CPU): a gloo ``ProcessGroup`` on top of the *same* store (our side here, the server's in
  ``vllm_worker/gloo_engine.py``), so the CPU tests run the rendezvous, the rank layout and the HTTP control
  sequence of the GPU path.

This module is imported inside vLLM worker processes: it must not import the rest of megatron_sao.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, Protocol

import torch

TransferBackend = Literal["nccl", "gloo"]
STORE_PREFIX = "sao-weight-transfer/"  # gloo's keys in the shared store, apart from vLLM's
READY_PREFIX = "sao-receiving/"  # the receivers' per-bucket readiness counters (GlooGroup.mark_receiving)


@dataclass(frozen=True)
class Rendezvous:
    """Where and how big a transfer group of one server is (what ``/init_weight_transfer_engine`` gets)."""

    master_address: str
    master_port: int
    server_world_size: int  # the server's TP * PP workers (DP = 1 per server)
    rank_offset: int = 1  # the trainer sender takes rank 0

    def __post_init__(self) -> None:
        if not self.master_address:
            raise ValueError("Rendezvous.master_address is empty (the trainer rank-0 host)")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"Rendezvous.master_port must be in 1..65535, got {self.master_port}")
        if self.server_world_size < 1:
            raise ValueError(f"Rendezvous.server_world_size must be >= 1, got {self.server_world_size}")
        if self.rank_offset < 1:
            raise ValueError(f"Rendezvous.rank_offset must be >= 1 (rank 0 is the trainer), got {self.rank_offset}")

    @property
    def world_size(self) -> int:
        return self.rank_offset + self.server_world_size

    def worker_init_info(self) -> dict:
        """The ``init_info`` body of ``POST /init_weight_transfer_engine`` (vLLM's NCCL init-info fields)."""
        return {"master_address": self.master_address, "master_port": self.master_port,
                "rank_offset": self.rank_offset, "world_size": self.world_size, "packed": False}


def worker_group_rank(rank_offset: int, tp_pp_rank: int, tp_pp_world_size: int, dp_index: int = 0) -> int:
    """A server worker's rank in the transfer group, by vLLM's rule (unique across DP replicas)."""
    return dp_index * tp_pp_world_size + tp_pp_rank + rank_offset


class TransferGroup(Protocol):
    def broadcast(self, tensor: torch.Tensor, src: int = 0, timeout_s: float | None = None) -> None: ...

    def synchronize(self) -> None: ...

    def close(self) -> None: ...


class GlooGroup:
    """A gloo ProcessGroup joined through a vLLM ``StatelessProcessGroup`` store.

    The store also carries the receivers' readiness: before a bucket's broadcast each receiving worker
    adds 1 to the bucket's counter (``mark_receiving``) and rank 0 sends once the counter reaches the
    number of workers (``wait_receiving``). A receive refused at once (no update session, a bad
    update_info) then shows as a failed receive call instead of a broadcast waiting for a worker that
    never joins it, without a fixed wait on every bucket."""

    def __init__(self, pg) -> None:
        self.pg = pg
        self.store_group = None  # the StatelessProcessGroup whose store the group met on (join_group)
        self.ready_store = None  # the same store under READY_PREFIX (join_group)
        self._ready_keys = 0

    def next_ready_key(self) -> str:
        """A fresh counter name for one bucket (rank 0)."""
        self._ready_keys += 1
        return str(self._ready_keys)

    def mark_receiving(self, key: str) -> None:
        """A receiver: this worker posts the bucket's receive next."""
        self.ready_store.add(key, 1)

    def receiving(self, key: str) -> int:
        """Rank 0: how many workers said they receive the bucket ``key``."""
        return int(self.ready_store.add(key, 0))

    def forget(self, key: str) -> None:
        """Rank 0: drop a bucket's counter once its broadcast is done."""
        self.ready_store.delete_key(key)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, timeout_s: float | None = None) -> None:
        work = self.pg.broadcast(tensor, src)
        if timeout_s is None:
            work.wait()
        else:  # a peer that hangs (not dies) fails this send after timeout_s instead of the group's timeout
            work.wait(timedelta(seconds=timeout_s))

    def synchronize(self) -> None:
        pass  # every gloo broadcast already waited

    def close(self) -> None:
        # Dropping the process group closes its connections, so a peer blocked on it fails at once;
        # dropping the store lets the next group's rendezvous use the port again.
        self.pg = None
        self.store_group = self.ready_store = None


class NcclGroup:
    """vLLM's PyNcclCommunicator; broadcasts on the current CUDA stream, synchronised per bucket."""

    def __init__(self, comm) -> None:
        self.comm = comm

    def broadcast(self, tensor: torch.Tensor, src: int = 0, timeout_s: float | None = None) -> None:
        # NCCL has no per-call timeout: a dead peer is found by the caller's timeout (docs/architecture.md).
        self.comm.broadcast(tensor, src=src, stream=torch.cuda.current_stream())

    def synchronize(self) -> None:
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        comm, self.comm = self.comm, None
        if comm is not None and hasattr(comm, "destroy"):
            comm.destroy()


def join_group(master_address: str, master_port: int, rank: int, world_size: int, backend: TransferBackend,
               timeout_s: float = 300.0) -> TransferGroup:
    """Join one transfer group as ``rank``; blocks until all ``world_size`` ranks arrived (or ``timeout_s``)."""
    from vllm.distributed.utils import StatelessProcessGroup

    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        if rank != 0:
            raise ValueError("join_group: on the NCCL path this process joins as the trainer (rank 0) only")
        return NcclGroup(trainer_init({"master_address": master_address, "master_port": master_port,
                                       "world_size": world_size}, 0))
    if backend != "gloo":
        raise ValueError(f"weight-transfer backend must be 'nccl' or 'gloo', got {backend!r}")
    from torch.distributed import PrefixStore
    from vllm.distributed.utils import init_gloo_process_group

    spg = StatelessProcessGroup.create(host=master_address, port=master_port, rank=rank, world_size=world_size,
                                       store_timeout=int(timeout_s))
    pg = init_gloo_process_group(PrefixStore(STORE_PREFIX, spg.store), rank, world_size,
                                 timeout=timedelta(seconds=timeout_s))
    group = GlooGroup(pg)
    group.store_group = spg  # keep the store (rank 0 hosts it) alive as long as the group
    group.ready_store = PrefixStore(READY_PREFIX, spg.store)
    return group


PACK_ALIGN = 16  # bytes: every tensor of a packed bucket starts at a multiple (a view needs its dtype's alignment)


def packed_layout(dtypes: list[torch.dtype], shapes: list[list[int]]) -> tuple[list[tuple[int, int]], int]:
    """Where each tensor of a packed bucket lies: ``[(start, nbytes)]`` and the buffer's size."""
    spans, at = [], 0
    for dtype, shape in zip(dtypes, shapes):
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        spans.append((at, n))
        at += -(-n // PACK_ALIGN) * PACK_ALIGN
    return spans, at


def pack_bucket(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One bucket as one flat byte buffer, tensors in order (``unpack_bucket`` cuts it back)."""
    spans, size = packed_layout([t.dtype for t in tensors], [list(t.shape) for t in tensors])
    flat = torch.empty(size, dtype=torch.uint8, device=tensors[0].device if tensors else "cpu")
    for t, (at, n) in zip(tensors, spans):
        flat[at:at + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return flat


def unpack_bucket(flat: torch.Tensor, dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[torch.Tensor]:
    """The tensors of a packed bucket, as views of ``flat`` (no copy)."""
    spans, size = packed_layout(dtypes, shapes)
    if size != flat.numel():
        raise ValueError(f"packed bucket has {flat.numel()} bytes, its tensors need {size}")
    return [flat[at:at + n].view(dtype).reshape(shape) for (at, n), dtype, shape in zip(spans, dtypes, shapes)]


def broadcast_bucket(group: TransferGroup, tensors: list[torch.Tensor], timeout_s: float | None = None,
                     packed: bool = False) -> int:
    """Send one bucket's tensors from rank 0 (the receivers allocate from names/shapes/dtypes), whatever
    the number of receivers: ``packed``, one broadcast of the bucket as one byte buffer (the gloo data
    plane: a gloo collective costs about the same for 1 KiB as for 1 MiB, and a Qwen3-MoE layer has
    hundreds of expert tensors); else one per tensor, in order. Returns the broadcasts made, when the
    bucket left this process, so its tensors may be freed."""
    sent = [pack_bucket(tensors)] if packed else [t.contiguous() for t in tensors]  # alive until synchronised
    for t in sent:
        group.broadcast(t, src=0, timeout_s=timeout_s)
    group.synchronize()
    return len(sent)


async def wait_receiving(group: GlooGroup, key: str, workers: int, receives: list, timeout_s: float) -> bool:
    """Rank 0, before broadcasting bucket ``key``: wait until ``workers`` receivers said they receive it
    (True), or one of the ``receives`` (the futures of the calls that make them receive) failed first
    (False); ``TimeoutError`` after ``timeout_s``. Polls the store (a local round trip) with a short
    backoff: what it waits for is the receivers' own arrival, never a fixed delay."""
    import asyncio
    import time

    deadline, pause = time.monotonic() + timeout_s, 0.0002
    while True:
        if any(f.done() and (f.cancelled() or f.exception() is not None) for f in receives):
            return False
        if group.receiving(key) >= workers:
            return True
        if time.monotonic() > deadline:
            raise TimeoutError(f"{workers} receiver(s) of bucket {key} did not all arrive in {timeout_s:.0f}s")
        await asyncio.sleep(pause)
        pause = min(2 * pause, 0.005)


async def send_bucket(group: TransferGroup, tensors: list[torch.Tensor], receive, ready_key: str | None = None,
                      workers: int = 0, timeout_s: float = 300.0) -> None:
    """Broadcast one bucket while ``receive`` (the awaitable that makes the workers receive it: an
    HTTP ``/update_weights`` or AsyncLLM's ``update_weights``) runs; return when both are done.

    A receive refused at once (bad names, no update session, a worker error) must not leave this
    process broadcasting to workers that will never join. On gloo (``ready_key``: the counter the
    ``workers`` receivers increment, ``GlooGroup.mark_receiving``) the broadcast starts when every
    worker is receiving; vLLM's NCCL engine does not say so, so there the receive gets a moment to
    fail first (vLLM's own trainer example does the same)."""
    import asyncio

    recv = asyncio.ensure_future(receive)
    if ready_key is not None:
        ready = await wait_receiving(group, ready_key, workers, [recv], timeout_s)
    else:
        await asyncio.wait({recv}, timeout=0.05)
        ready = not (recv.done() and recv.exception() is not None)
    if not ready:
        await recv  # raises the refusal
    try:
        await asyncio.to_thread(broadcast_bucket, group, tensors)
    finally:
        await recv
        if ready_key is not None:
            group.forget(ready_key)
