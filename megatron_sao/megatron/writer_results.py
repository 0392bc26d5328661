"""The queue megatron's checkpoint writers report through, in a server process that dies with the trainer.

megatron-core 0.16.1's torch_dist writer (dist_checkpointing/strategies/filesystem_async.py) sends every
save's write results through one `multiprocessing` Manager queue per process, created on the first save
(`_get_write_results_queue`: a spawned server process, synchronous saves included). A trainer killed with
SIGKILL (a lost node, `kill -9`, the resume tests) leaves that server running for good, holding the
trainer's stdout and stderr: seen here, a Manager server still alive minutes after its trainer died, and a
caller that reads the trainer's output pipes waits for it forever. And a spawned process imports the
parent's `__main__` again, which runs a script without a `__main__` guard a second time (a test worker:
it tried to join the process group again and failed with EADDRINUSE). So the trainer creates the queue
itself, a SyncManager's Queue like megatron's, with two differences: the server is forked (as megatron's
writers are), and it asks the kernel to SIGKILL it when its parent dies (Linux PR_SET_PDEATHSIG), exiting
at once if the parent is already gone.
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
    """Runs first in the Manager's server process."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the server outlives a killed trainer, as megatron's does
        pass
    if os.getppid() != parent:  # the trainer died before prctl took effect
        os._exit(0)


def install() -> None:
    """Give megatron's writers our queue (once per process, before the first save)."""
    global _MANAGER
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    with _LOCK:
        if filesystem_async._results_queue is not None:
            return
        _MANAGER = SyncManager(ctx=mp.get_context("fork"))
        _MANAGER.start(_die_with, (os.getpid(),))
        filesystem_async._results_queue = _MANAGER.Queue()
