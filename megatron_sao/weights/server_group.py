"""One weight-transfer group for every rollout server: the trainer's rank 0 broadcasts each tensor once.

The group is trainer rank 0 plus the workers of every server in the update, at rank offsets 1,
1 + tp_0, 1 + tp_0 + tp_1, ... (vLLM's ``rank_offset`` in its NCCL init info exists for this; a
worker's rank is ``rank_offset + tp_pp_rank``, ``transfer_group.worker_group_rank``). Each bucket is
sent once by rank 0 while every member's ``/update_weights`` receives it: on gloo one broadcast of the
bucket packed into one byte buffer (``init_info.packed``, which our ``sao_gloo`` engine unpacks), on
NCCL one broadcast per tensor (vLLM's NCCL engine as it is), so what rank 0 does per update does not
grow with the server count (on NCCL the collective's ring/tree moves the bytes; gloo's broadcast is
its own algorithm over TCP). On gloo rank 0 starts a bucket's broadcast when every worker has said it
is receiving it (a counter in the group's store, ``transfer_group.wait_receiving``), so a receive
refused at once or late fails that member instead of leaving the broadcast blocked on it, and no
fixed wait is paid; vLLM's NCCL engine does not say so, so on NCCL the first bucket of an update
gives refusals a short window (50 ms) first.

The group is formed once and reused: it is re-formed only when the set of servers in the update
changes (a server left the pool, a restarted one is readmitted) or after a failure broke it. Forming
it is one concurrent ``/init_weight_transfer_engine`` per member while rank 0 joins the rendezvous,
on the next of the configured ports (the launch plan gives one per server), so a re-formed group
never meets on the store of the group it replaces.

A member that fails mid-update (its receive fails or times out, or the broadcast breaks) is dropped
from the update without hanging the others: rank 0 closes the group at once (a receiver blocked on
it then fails instead of waiting out the timeout), members whose receive failed but that still
answer their health check get the bucket again over a group re-formed without the dead ones (once per
update), and the rest of the update goes over that group. Receivers load a bucket only after all of
it arrived and skip tensors they already loaded in this update (``vllm_worker/gloo_engine.py``), so a
bucket sent twice is loaded once. vLLM's own NCCL engine loads tensor by tensor, so on NCCL there is
no resend (a member whose receive failed is dropped), and NCCL has no timeout on a dead peer: see
docs/architecture.md for what that leaves on the GPU path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from megatron_sao.weights.buckets import bucket_update_info

logger = logging.getLogger(__name__)


class GroupMember(Protocol):
    """What the group needs of a server (``VLLMServerClient``)."""

    name: str
    transfer_world_size: int  # the server's TP * PP workers

    async def join_transfer_group(self, init_info: dict) -> None: ...

    async def receive_bucket(self, update_info: dict) -> None: ...

    async def reopen_update(self) -> None: ...

    async def health(self) -> bool: ...


def rank_offsets(world_sizes: Sequence[int]) -> list[int]:
    """Each server's first rank in the shared group: rank 0 is the trainer, then the servers in order."""
    offsets, nxt = [], 1
    for w in world_sizes:
        if w < 1:
            raise ValueError(f"a server's transfer world size must be >= 1, got {w}")
        offsets.append(nxt)
        nxt += w
    return offsets


def member_init_info(master_address: str, master_port: int, rank_offset: int, world_size: int,
                     packed: bool = False) -> dict:
    """The ``init_info`` body of ``POST /init_weight_transfer_engine`` (vLLM's NCCL init-info fields)."""
    return {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "packed": packed}


def _why(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return f"{type(e).__name__}: {e}"


class ServerTransferGroup:
    """Rank 0's side of the shared group (see the module docstring). ``ports``: used in turn, one per
    formation; ``backend``: ``nccl`` (GPU) or ``gloo`` (CPU); ``timeout_s``: one formation or one bucket."""

    def __init__(self, master_address: str, ports: Sequence[int], backend: str, timeout_s: float) -> None:
        if not master_address or not ports:
            raise ValueError("ServerTransferGroup needs the trainer rank-0 address and at least one port "
                             "(rollout.weight_transfer_master_address / rollout.weight_transfer_ports)")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"ServerTransferGroup backend must be 'nccl' or 'gloo', got {backend!r}")
        self.master_address, self.ports, self.backend = master_address, tuple(ports), backend
        self.timeout_s = float(timeout_s)
        self.members: tuple = ()  # the servers the current group was formed over, in rank order
        # gloo: one broadcast per bucket (our engine unpacks it); nccl: one per tensor, vLLM's engine as it is
        self.packed = backend == "gloo"
        self.broadcasts = 0  # broadcasts rank 0 made, ever (what the tests and the benchmark count)
        self.bucket_sends = 0  # buckets rank 0 sent (a resend after a failure counts again)
        self.formations = 0
        self.formation_seconds = 0.0  # the last formation's wall time
        self._group = None
        self._proven = False  # NCCL: a bucket of this update went through this group, no refusal window needed

    # ------------------------------------------------------------------ formation
    async def ensure(self, members: Sequence[GroupMember]) -> dict:
        """Have a group over exactly ``members``: reuse the current one, or form a new one. Returns
        ``{member: why}`` for the members that could not join (the group is over the others)."""
        members = tuple(members)
        if self._group is not None and members == self.members:
            return {}
        # Every rank must arrive or nobody's rendezvous ends before the timeout: a server that does not
        # answer (killed, restarting) is left out first, which costs one health call per formation.
        healthy = await asyncio.gather(*(self._healthy(m) for m in members))
        failed = {m: "does not answer its health check" for m, ok in zip(members, healthy) if not ok}
        members = tuple(m for m in members if m not in failed)
        joined = await self._form(members)
        if joined and len(joined) < len(members):  # the group did not form: once more without them
            joined.update(await self._form(tuple(m for m in members if m not in joined)))
        return {**failed, **joined}

    async def _form(self, members: tuple) -> dict:
        from megatron_sao.weights.vllm_worker.transfer_group import join_group

        self.close()
        if not members:
            return {}
        port = self.ports[self.formations % len(self.ports)]
        self.formations += 1
        offsets = rank_offsets([m.transfer_world_size for m in members])
        world = 1 + sum(m.transfer_world_size for m in members)
        t0 = time.perf_counter()
        inits = [asyncio.ensure_future(asyncio.wait_for(
            m.join_transfer_group(member_init_info(self.master_address, port, off, world, self.packed)),
            self.timeout_s))
            for m, off in zip(members, offsets)]
        try:
            group = await asyncio.to_thread(join_group, self.master_address, port, 0, world, self.backend,
                                            self.timeout_s)
            join_error = None
        except Exception as e:  # a member never arrived; the inits say which
            group, join_error = None, e
        results = await asyncio.gather(*inits, return_exceptions=True)
        failed = {m: f"joining the transfer group failed: {_why(r)}" for m, r in zip(members, results)
                  if isinstance(r, BaseException)}
        if group is None:
            if not failed:
                failed = {m: f"the transfer group did not form: {_why(join_error)}" for m in members}
            return failed
        if failed:  # formed without them? cannot be: every rank had to arrive. Treat it as broken.
            group.close()
            return failed
        self._group, self.members = group, members
        self.formation_seconds = time.perf_counter() - t0
        logger.info("weight-transfer group formed over %d server(s), world %d, port %d, in %.2fs",
                    len(members), world, port, self.formation_seconds)
        return {}

    def new_update(self) -> None:
        """A new update starts: on NCCL its first bucket gets the refusal window again (``_send_once``)."""
        self._proven = False

    def close(self) -> None:
        self._proven = False
        group, self._group, self.members = self._group, None, ()
        if group is not None:
            group.close()

    # ------------------------------------------------------------------ one bucket
    async def send_bucket(self, bucket: list[tuple[str, torch.Tensor]], retry: set | None = None) -> dict:
        """Broadcast ``bucket`` once to the group's members while each receives it; return
        ``{member: why}`` for those dropped from the update. ``retry``: members still allowed a second
        try in this update (a member retried is removed from it)."""
        if self._group is None:
            raise RuntimeError("ServerTransferGroup.send_bucket before the group was formed")
        members = self.members
        failed = await self._send_once(bucket)
        if not failed:
            return {}
        # The group is broken for everyone: dead members go, healthy ones that failed get one more try.
        self.close()
        retry = retry if retry is not None else set()
        healthy = await asyncio.gather(*(self._healthy(m) for m in failed))
        # A resend needs receivers that load a bucket once (ours, gloo); vLLM's NCCL engine loads tensor
        # by tensor, so on NCCL a member whose receive failed is dropped (docs/architecture.md).
        again = [m for m, ok in zip(failed, healthy) if ok and m in retry] if self.backend == "gloo" else []
        dropped = {m: why for m, why in failed.items() if m not in again}
        for m in again:
            retry.discard(m)
        survivors = [m for m in members if m not in dropped]
        dropped.update(await self.ensure(survivors))
        # A worker whose receive failed left its update session (vLLM's Worker.update_weights ends it on
        # any error): reopened, it takes the bucket again and keeps what it loaded before.
        reopened = await asyncio.gather(*(asyncio.wait_for(m.reopen_update(), self.timeout_s) for m in again),
                                        return_exceptions=True)
        lost = {m: f"reopening its update failed: {_why(r)}" for m, r in zip(again, reopened)
                if isinstance(r, BaseException)}
        if lost:
            dropped.update(lost)
            dropped.update(await self.ensure([m for m in survivors if m not in dropped]))
        if any(m not in dropped for m in again) and self._group is not None:
            dropped.update(await self.send_bucket(bucket, retry))
        return dropped

    async def _healthy(self, member: GroupMember) -> bool:
        try:
            return bool(await asyncio.wait_for(member.health(), self.timeout_s))
        except Exception:  # no answer is unhealthy
            return False

    async def _send_once(self, bucket) -> dict:
        from megatron_sao.weights.vllm_worker.transfer_group import broadcast_bucket, wait_receiving

        info = bucket_update_info(bucket)
        members, group, ready_key = self.members, self._group, None
        if self.backend == "gloo":
            info["ready_key"] = ready_key = group.next_ready_key()
        recvs = [asyncio.ensure_future(asyncio.wait_for(m.receive_bucket(info), self.timeout_s)) for m in members]
        # A receive refused at once (no update session, a bad update_info) would leave the broadcast
        # waiting for a worker that never joins it. On gloo every worker says when it is receiving
        # (transfer_group.wait_receiving); vLLM's NCCL engine does not, so there the refusals get a
        # moment to show first, on the first bucket of an update or of a new group (a later bucket meets
        # the same sessions).
        refused, sender_error = False, None
        if ready_key is not None:
            try:
                refused = not await wait_receiving(group, ready_key, sum(m.transfer_world_size for m in members),
                                                   recvs, self.timeout_s)
            except TimeoutError as e:
                refused, sender_error = True, _why(e)
        else:
            if not self._proven:
                await asyncio.wait(recvs, timeout=0.05)
            refused = any(f.done() and f.exception() is not None for f in recvs)
        if not refused:
            tensors = [t for _, t in bucket]
            self.bucket_sends += 1
            try:
                self.broadcasts += await asyncio.to_thread(broadcast_bucket, group, tensors, self.timeout_s,
                                                           self.packed)
                if ready_key is not None:
                    group.forget(ready_key)
            except Exception as e:  # a peer died or hung: every member's receive below says which
                # Only its text is kept: the failed call's frames hold the gloo work, which keeps the
                # group's connections open, and the receivers must see them close.
                sender_error = _why(e)
        if refused or sender_error is not None:
            self.close()  # receivers blocked on the group fail now instead of waiting out the timeout
        results = await asyncio.gather(*recvs, return_exceptions=True)
        failed = {m: f"receiving a bucket failed: {_why(r)}" for m, r in zip(members, results)
                  if isinstance(r, BaseException)}
        del results
        self._proven = not failed and sender_error is None and not refused
        if sender_error is not None and not failed:  # every member has it; only the group is gone
            logger.warning("weight-transfer broadcast failed after every server received it (%s); the group "
                           "is re-formed", sender_error)
            await self.ensure(members)
        return failed
