"""The trainer <-> rollout-server weight-transfer group: rendezvous arithmetic and the data plane.

One group per rollout server: the trainer's global rank 0 is rank 0, the server's TP*PP workers are
ranks ``rank_offset + worker_rank`` (vLLM's rule, ``nccl_common.worker_init_process_group``), so the
world is ``1 + tp * pp``. The rendezvous is vLLM's ``StatelessProcessGroup`` (a TCPStore that rank 0
hosts at ``master_address:master_port``): the address must be the trainer rank-0 host as the servers
see it, and every server needs its own port, because each group is a separate store.

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


@dataclass(frozen=True)
class Rendezvous:
    """Where and how big one server's transfer group is (what ``/init_weight_transfer_engine`` gets)."""

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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host`` (a small race remains; fine for one machine)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class TransferGroup(Protocol):
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None: ...

    def synchronize(self) -> None: ...

    def close(self) -> None: ...


class GlooGroup:
    """A gloo ProcessGroup joined through a vLLM ``StatelessProcessGroup`` store."""

    def __init__(self, pg) -> None:
        self.pg = pg
        self.store_group = None  # vLLM's StatelessProcessGroup (its TCPStore), kept alive with the group

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.pg.broadcast(tensor, src).wait()

    def synchronize(self) -> None:
        pass  # every gloo broadcast already waited

    def close(self) -> None:
        # Drop the group and the store it met through (rank 0 hosts the store: its port is freed
        # for the next group, e.g. with a restarted server).
        self.pg = None
        self.store_group = None


class NcclGroup:
    """vLLM's PyNcclCommunicator; broadcasts on the current CUDA stream, synchronised per bucket."""

    def __init__(self, comm) -> None:
        self.comm = comm

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
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
    return group


def broadcast_bucket(group: TransferGroup, tensors: list[torch.Tensor]) -> None:
    """Send one bucket's tensors from rank 0, in order (the receivers allocate from names/shapes/dtypes);
    returns when the bucket left this process, so its tensors may be freed."""
    sent = [t.contiguous() for t in tensors]  # keep non-contiguous copies alive until synchronised
    for t in sent:
        group.broadcast(t, src=0)
    group.synchronize()


async def send_bucket(group: TransferGroup, tensors: list[torch.Tensor], receive) -> None:
    """Broadcast one bucket while ``receive`` (the awaitable that makes the workers receive it: an
    HTTP ``/update_weights`` or AsyncLLM's ``update_weights``) runs; return when both are done.

    A receive refused at once (bad names, no update session, a worker error) must not leave this
    process broadcasting to workers that will never join: it gets a moment to fail first (vLLM's own
    trainer example does the same)."""
    import asyncio

    recv = asyncio.ensure_future(receive)
    await asyncio.wait({recv}, timeout=0.05)
    if recv.done() and recv.exception() is not None:
        raise recv.exception()
    try:
        await asyncio.to_thread(broadcast_bucket, group, tensors)
    finally:
        await recv
