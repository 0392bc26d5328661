"""The SWE environment: mini-swe-agent fixes a repository in the sandbox; the hidden tests give the reward.

One episode (``SWEEnv.run_harness``, the ``envs.base.HarnessEnvironment`` protocol):

1. the task's repository is written on the host (envs/swe/tasks.py) and copied into a sandbox workspace
   (envs/sandbox_workspace.py), where every command of the agent runs, each in a fresh sandbox call;
2. mini-swe-agent runs in a harness thread (envs/swe/harness.py), its model going over litellm to this
   episode's endpoint (``ModelEndpoint``: the policy, behind rollout/agent_endpoint/), until it submits,
   reaches its step limit, or its model is refused (the episode's turn or token limit);
3. the per-task wall limit (``wall_limit_s``): past it the harness is stopped -- its model access is
   closed (``endpoint.stop()``) and its next command refused -- and the episode is graded as it stands;
4. grading (envs/swe/grading.py) copies the workspace into a fresh one, puts the hidden tests in and runs
   them; the reward is 1.0 iff every FAIL_TO_PASS and PASS_TO_PASS test passes. The environment's grader
   decides: nothing the harness reports counts.

Lifetimes: the workspace lives from the start of the episode until ``close()``, after grading, whatever
the deadlines (no timer removes it under the scorer); the harness's wall limit plus the grading's
(``grade_timeout_s``) must fit in the rollout's deadline (``rollout.timeout_s``; the config checks it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_sao.envs.base import HarnessOutcome, ModelEndpoint, Task, check_task_env
from megatron_sao.envs.sandbox import SandboxLimits, SandboxPool, SandboxWorkspace, default_pool
from megatron_sao.envs.swe.grading import grade
from megatron_sao.envs.swe.harness import run_agent
from megatron_sao.envs.swe.shell import SandboxShell
from megatron_sao.envs.swe.tasks import ENV_NAME, load_swe_tasks, materialize

# Harness threads (mini-swe-agent blocks on HTTP and on its commands): one per episode in flight, so not
# the event loop's default executor (min(32, cores + 4) threads would cap a 2-core host at 6 episodes).
_THREADS = ThreadPoolExecutor(max_workers=int(os.environ.get("SAO_HARNESS_THREADS", "256")),
                              thread_name_prefix="sao-harness")
_POOLS: dict[tuple, SandboxPool] = {}
__all__ = ["SWEEnv", "load_swe_tasks"]
STOP_GRACE_S = 30.0  # after the wall limit: how long the harness may take to notice (beyond a command)

COMMAND_LIMITS = dict(wall_time_s=60.0, cpu_time_s=60, memory_mb=2048, max_processes=64, max_output_bytes=65536,
                      max_file_mb=64, max_disk_mb=1024, max_files=50_000, max_open_files=256)
TEST_LIMITS = dict(COMMAND_LIMITS, wall_time_s=300.0, cpu_time_s=300)


def sandbox_pool(isolation: str, readonly_paths: tuple[str, ...]) -> SandboxPool:
    """The process's pool for these settings ("auto" with no extra paths: the default pool, whose
    same-uid setting comes from env.sandbox_allow_same_uid)."""
    if isolation == "auto" and not readonly_paths:
        return default_pool()
    key = (isolation, readonly_paths)
    if key not in _POOLS:
        base = default_pool()
        _POOLS[key] = SandboxPool(max_concurrency=base.max_concurrency, allow_same_uid=base.allow_same_uid,
                                  isolation=isolation, readonly_paths=readonly_paths)
    return _POOLS[key]


@dataclass
class SWEEnv:
    """One SWE episode (module docstring). The fields are ``env.kwargs``."""

    agent_config: str = "swebench"  # swebench | compact | a YAML path (envs/swe/harness.py)
    model_class: str = "litellm"  # mini-swe-agent's: litellm (tool calls), litellm_textbased (```bash blocks)
    step_limit: int = 300  # the agent's model calls (the paper's 300 turns)
    wall_limit_s: float = 3000.0  # per task: past it the harness is stopped and the episode graded
    grade_timeout_s: float = 600.0  # the hidden tests' wall clock
    request_timeout_s: float = 1800.0  # one model call of the harness (a long turn on a busy server)
    command_limits: dict = field(default_factory=dict)  # SandboxLimits of every agent command (COMMAND_LIMITS)
    test_limits: dict = field(default_factory=dict)  # of the grading run (TEST_LIMITS)
    isolation: str = "auto"  # the sandbox mode: auto | namespaces | process
    readonly_paths: list = field(default_factory=list)  # host dirs the commands may read (a repo's Python env)
    model_kwargs: dict = field(default_factory=dict)  # more litellm arguments
    name: str = ENV_NAME

    @classmethod
    def limits_of(cls, kwargs: dict) -> dict[str, float]:
        """The wall limit and grading time ``env.kwargs`` give (the config's deadline check)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown SWEEnv argument(s) {unknown}; known: {sorted(names - {'name'})}")
        out = {k: float(kwargs.get(k, getattr(cls, k))) for k in ("wall_limit_s", "grade_timeout_s")}
        if min(out.values()) <= 0:
            raise ValueError(f"wall_limit_s and grade_timeout_s must be > 0, got {out}")
        return out

    def __post_init__(self) -> None:
        self.pool = sandbox_pool(self.isolation, tuple(self.readonly_paths))
        self._limits = SandboxLimits(**{**COMMAND_LIMITS, **self.command_limits})
        self._test_limits = SandboxLimits(**{**TEST_LIMITS, **self.test_limits, "wall_time_s": self.grade_timeout_s})
        self._ws: SandboxWorkspace | None = None
        self._thread: Future | None = None
        self._shell: SandboxShell | None = None

    async def run_harness(self, task: Task, endpoint: ModelEndpoint) -> HarnessOutcome:
        check_task_env(self.name, task)
        t0 = time.monotonic()
        self._ws = await self._workspace(task)
        loop = asyncio.get_running_loop()
        self._shell = SandboxShell(self._ws, loop, self._limits)
        problem = task.messages[-1]["content"]
        self._thread = _THREADS.submit(run_agent, problem, endpoint, self._shell, self.agent_config,
                                       step_limit=self.step_limit, wall_limit_s=self.wall_limit_s,
                                       request_timeout_s=self.request_timeout_s, model_class=self.model_class,
                                       model_kwargs=self.model_kwargs)
        info: dict[str, Any] = {}
        try:
            info.update(await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._thread)), self.wall_limit_s))
        except TimeoutError:
            info.update(exit_status="WallLimit", harness_error=None)
            await self._stop(endpoint)
        info["agent_s"] = time.monotonic() - t0
        report = await grade(self._ws, task.answer, self._test_limits)
        info.update(report.info(task.answer["fail_to_pass"], task.answer["pass_to_pass"]))
        info["grade_s"] = time.monotonic() - t0 - info["agent_s"]
        return HarnessOutcome(report.reward, info)

    async def _workspace(self, task: Task) -> SandboxWorkspace:
        src = Path(tempfile.mkdtemp(prefix="sao-swe-repo-"))
        try:
            await asyncio.to_thread(materialize, task, src)
            lim = self._limits
            return await self.pool.open_workspace(src, max_bytes=lim.max_disk_mb << 20, max_files=lim.max_files)
        finally:
            await asyncio.to_thread(shutil.rmtree, src, True)

    async def _stop(self, endpoint: ModelEndpoint) -> None:
        """The wall limit: no more model calls, no more commands; wait for the harness to notice."""
        if endpoint.stop is not None:
            endpoint.stop()
        if self._shell is not None:
            self._shell.stopped = True
        if self._thread is not None:
            await asyncio.wait({asyncio.wrap_future(self._thread)}, timeout=self._limits.wall_time_s + STOP_GRACE_S)

    async def close(self) -> None:
        """Stop what is left of the harness and remove the workspace (after grading, or when cancelled)."""
        if self._shell is not None:
            self._shell.stopped = True
        if self._thread is not None and not self._thread.done():
            await asyncio.wait({asyncio.wrap_future(self._thread)}, timeout=self._limits.wall_time_s + STOP_GRACE_S)
        if self._ws is not None:
            await self._ws.close()
            self._ws = None
