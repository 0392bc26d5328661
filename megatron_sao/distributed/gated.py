"""Collectives that may follow a phase only rank 0 runs, each entered through the rank-0 gate.

Rank 0 alone waits for a batch, evaluates, starts the rollout engines and pushes weights; the other
ranks would wait for it inside the next collective, where the process-group timeout (and on GPUs the
NCCL watchdog) runs. So every such collective first waits at the rank-0 gate (``rank0_gate.py``),
outside any collective, and enters only after rank 0 did (docs/architecture.md, "Timeouts").
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from megatron_sao.distributed import rank0_gate

logger = logging.getLogger(__name__)


class GatedCollectives:
    """Broadcast, barrier and an any-rank flag over the whole world (``ctx``: rank, world_size, device)."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx

    def wait_for_rank0(self, what: str) -> None:
        waited = rank0_gate.shared().arrive(what)
        if waited > 60:
            logger.info("rank %d waited %.0fs for rank 0 to reach %s", self.ctx.rank, waited, what)

    def broadcast(self, obj, what: str = "a broadcast"):
        """Rank 0's ``obj`` on every rank."""
        if self.ctx.world_size == 1:
            return obj
        self.wait_for_rank0(what)
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.ctx.device)
        return box[0]

    def barrier(self) -> None:
        if self.ctx.world_size > 1:
            self.wait_for_rank0("a barrier")
            dist.barrier()

    def any_rank(self, flag: bool, what: str) -> bool:
        """True on every rank when ``flag`` is true on any (e.g. the stop agreement after a signal)."""
        t = torch.tensor([1.0 if flag else 0.0], device=self.ctx.device)
        if self.ctx.world_size > 1:
            self.wait_for_rank0(what)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())
