"""Checkpoint writes that go on while training does: megatron-core's AsyncCallsQueue, one checkpoint at a time.

`dist_checkpointing.save(..., async_sharded_save=True)` (dist_state.save) does the collective part of a save
at once (planning, the distributed optimizer's gather into model space, rank 0's common.pt) and returns an
AsyncRequest; scheduling it forks a writer process per rank (megatron's TemporalAsyncCaller). The writer
sees the trainer's memory as it was at the fork (copy-on-write; on a GPU megatron first copies the shards to
host memory), so the next steps may update the weights while it writes. Finalizing is collective: every
rank asks whether every writer is done (one all-reduce), and when all are, megatron's own finalize steps
(the global .metadata, then metadata.json) run, then ours (the trainer's commit), on every rank in order.

The fork-based caller, not megatron's persistent one: the persistent worker is a spawned process that
gets the tensors through a multiprocessing queue, which on a CPU build hands it the live parameters in
shared memory (no copy), while training goes on writing them.
"""

from __future__ import annotations

import logging
from typing import Callable

logger = logging.getLogger(__name__)


class AsyncSaves:
    """The writes of at most one checkpoint in flight. Every method but `abort` is collective."""

    def __init__(self) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self._queue = AsyncCallsQueue(persistent=False)

    @property
    def pending(self) -> bool:
        return self._queue.get_num_unfinalized_calls() > 0

    def schedule(self, requests: list, finalize: Callable[[], None]) -> None:
        """Start writing `requests` (the AsyncRequests of one checkpoint, the same count on every rank);
        `finalize` runs on every rank once all of them are written everywhere."""
        if self.pending:
            raise RuntimeError("a checkpoint is still being written: wait() for it before the next")
        if not requests:
            raise ValueError("a checkpoint with nothing to write")
        requests[-1].add_finalize_fn(finalize)
        for request in requests:
            self._queue.schedule_async_request(request)

    def poll(self) -> bool:
        """Finalize what every rank has finished writing; True when nothing is left in flight."""
        if self.pending:
            self._queue.maybe_finalize_async_calls(blocking=False)
        return not self.pending

    def wait(self) -> None:
        """Block until the checkpoint in flight is written everywhere and finalized."""
        if self.pending:
            self._queue.maybe_finalize_async_calls(blocking=True)

    def abort(self) -> None:
        """Local: kill this rank's writers and forget what they wrote (after an error, when the other ranks
        may not come to a collective). Nothing is finalized, so nothing is committed."""
        if self.pending:
            logger.warning("abandoning a checkpoint still being written (it is not committed)")
            for call in self._queue.async_calls:
                call.async_caller.close(abort=True)  # the fork-based caller kills its writer process
            self._queue.async_calls.clear()
