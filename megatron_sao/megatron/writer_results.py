"""The queues megatron's checkpoint writers report through: one per save, in a server that dies with the trainer.

megatron-core 0.16.1's torch_dist writer (dist_checkpointing/strategies/filesystem_async.py) sends a save's
write results (which file holds which shard) through a `multiprocessing` Manager queue, one per process,
created on the first save (`_get_write_results_queue`: a spawned server process; synchronous saves too).
Three things go wrong with it here:
- Two asynchronous saves in flight (the actor's and the critic's) share that queue, and each finalize takes
  whichever result came first: an engine's index then names the other engine's files, and its load fails
  with KeyError: MetadataIndex(...) (seen: a TP 2 run's checkpoint that TP 1 could not load).
- A trainer killed with SIGKILL (a lost node, `kill -9`, the resume tests) leaves the server running for
  good, holding the trainer's stdout and stderr (seen: alive minutes later; a caller reading the trainer's
  output pipes waits forever).
- A spawned process imports the parent's `__main__` again, which runs a script without a `__main__` guard
  a second time (a test worker: it joined the process group again and failed with EADDRINUSE).
So before each save the trainer gives megatron a new queue of its own server: a SyncManager like
megatron's, but forked (as megatron's writers are) and killed by the kernel when its parent dies (Linux
PR_SET_PDEATHSIG; it exits at once if the parent is already gone). A writer keeps the queue it was
planned with, so saves in flight never share one.

The server lives as long as the trainer, so it is forked before the models are built (`start_server`, the
trainer's first step): a fork shares the parent's pages copy-on-write, and every page the trainer writes
afterwards (weights, optimizer state, the activations' reused heap) is copied while the server keeps the
original. Forked at the first save instead, it held a copy of the whole trainer by the end of the run (seen:
a SmolLM2 SAO trainer of 12 GiB beside a server of 9 GiB, killed by the kernel's OOM killer on 24 GiB).
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import threading
from multiprocessing.managers import SyncManager

_PR_SET_PDEATHSIG = 1
_LOCK = threading.Lock()
_MANAGER: SyncManager | None = None


def _die_with(parent: int) -> None:
    """Runs first in the Manager's server process. It ignores SIGTERM (multiprocessing already ignores
    SIGINT there): a scheduler's cancel or preemption signals every process of the job, and the trainer
    answers by writing a checkpoint, through this server. Forked before the models, it has the handler of
    `sao train`'s start-up (cli.exit_on_sigterm), which would end it first."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the server outlives a killed trainer, as megatron's does
        pass
    if os.getppid() != parent:  # the trainer died before prctl took effect
        os._exit(0)


def start_server() -> int:
    """Fork the queues' server now, while this process is small (module docstring), if it is not running;
    returns its pid. `install_new_queue` starts it on first use otherwise."""
    global _MANAGER
    with _LOCK:
        if _MANAGER is None:
            _MANAGER = SyncManager(ctx=mp.get_context("fork"))
            _MANAGER.start(_die_with, (os.getpid(),))
        return _MANAGER._process.pid


def install_new_queue() -> None:
    """Give the next save's writer a queue of its own (call before each dist_checkpointing.save)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    start_server()
    with _LOCK:
        filesystem_async._results_queue = _MANAGER.Queue()
