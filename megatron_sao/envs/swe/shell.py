"""mini-swe-agent's execution environment over the project's sandbox: every command in a fresh sandbox call.

mini-swe-agent calls ``env.execute({"command": ...})`` from its own (synchronous) thread and expects
``{"output", "returncode", "exception_info"}``, as its ``LocalEnvironment`` returns them (stderr joined to
stdout); a command whose first output line is ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` (exit 0) submits
(``Submitted``). Here the command runs as ``bash -c`` in the episode's sandbox workspace
(envs/sandbox_workspace.py) on the rollout's event loop, which the harness thread waits on; one command at
a time, each a new process tree (as mini-swe-agent's own environments: "every action is executed in a new
subshell"), under the call's limits: a command past its wall clock or output cap is killed and reported
in ``exception_info`` with return code -1, as mini-swe-agent reports a timeout.

The template variables are the workspace's path and the machine's ``platform.uname()`` fields (the
swebench config's system information); unlike ``LocalEnvironment`` none of the trainer's environment
variables, which may hold credentials, reaches the prompt.
"""

from __future__ import annotations

import asyncio
import platform
import shlex
from dataclasses import dataclass
from typing import Any

from megatron_sao.envs.sandbox import SandboxLimits, SandboxWorkspace

SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class HarnessStopped(RuntimeError):
    """The episode's wall limit passed: the agent may run no further command."""


@dataclass
class ShellConfig:
    cwd: str
    timeout: float


class SandboxShell:
    """mini-swe-agent's ``Environment`` protocol (execute, get_template_vars, serialize)."""

    def __init__(self, workspace: SandboxWorkspace, loop: asyncio.AbstractEventLoop, limits: SandboxLimits) -> None:
        self.workspace, self.loop, self.limits = workspace, loop, limits
        self.config = ShellConfig(cwd=workspace.cwd, timeout=limits.wall_time_s)
        self.stopped = False
        self.commands = 0

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        if self.stopped:
            raise HarnessStopped("the episode's wall limit passed (env.kwargs.wall_limit_s)")
        command = action.get("command", "")
        if cwd:
            command = f"cd {shlex.quote(cwd)} && {command}"
        self.commands += 1
        future = asyncio.run_coroutine_threadsafe(self.workspace.shell(command, self.limits), self.loop)
        res = future.result()
        output = res.stdout
        if res.stdout_truncated:
            output += f"\n[output truncated at {self.limits.max_output_bytes} bytes]"
        if res.killed_reason is not None:
            out = {"output": output, "returncode": -1,
                   "exception_info": f"An error occurred while executing the command: {res.killed_reason}"}
        else:
            out = {"output": output, "returncode": res.exit_code, "exception_info": ""}
        self._check_finished(out)
        return out

    @staticmethod
    def _check_finished(output: dict) -> None:
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT and output["returncode"] == 0:
            from minisweagent.exceptions import Submitted

            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {"cwd": self.config.cwd, "timeout": self.config.timeout, **platform.uname()._asdict(), **kwargs}

    def serialize(self) -> dict:
        return {"info": {"config": {"environment": {"cwd": self.config.cwd, "timeout": self.config.timeout},
                                    "environment_type": f"{type(self).__module__}.{type(self).__name__}"}}}
