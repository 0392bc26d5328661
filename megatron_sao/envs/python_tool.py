"""The ``python`` tool shared by the math and coding environments: tool calls -> sandbox -> text, and
``PythonToolEnv``, the step both run (tool turns until the policy answers, the answer graded by the
subclass)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_sao.envs.base import StepResult, Task, check_task_env, require_task
from megatron_sao.envs.sandbox import SandboxLimits, SandboxPool, run_python
from megatron_sao.envs.tool_calls import ToolCall, format_tool_response, parse_tool_calls

TOOL_NAME = "python"

TOOL_INSTRUCTIONS = (
    "You can run Python code. To do so, write\n"
    '<tool_call>{"name": "python", "arguments": {"code": "print(2**10)"}}</tool_call>\n'
    "and the printed output comes back inside <tool_response></tool_response>. Each call runs in a "
    "fresh process (no state is kept between calls), with the standard library only, no network "
    "and a few seconds of time; print everything you want to see."
)


@dataclass
class ToolTurn:
    """The outcome of executing the tool calls of one model turn."""

    observation: str
    executed: int  # calls that reached the sandbox
    errors: int  # malformed calls, unknown tools, failing or killed programs


async def execute_tool_calls(calls: list[ToolCall], limits: SandboxLimits, pool: SandboxPool | None,
                             max_calls_per_turn: int) -> ToolTurn:
    """Run the calls of one turn in order; each gets its own ``<tool_response>`` block.

    Calls beyond ``max_calls_per_turn`` are answered with an error instead of being run, so one
    turn cannot monopolise the sandbox.
    """
    parts: list[str] = []
    executed = errors = 0
    for i, call in enumerate(calls):
        if i >= max_calls_per_turn:
            parts.append(format_tool_response(
                f"error: at most {max_calls_per_turn} tool calls are run per turn; this one was skipped"))
            errors += 1
            continue
        text, ran, failed = await _execute_one(call, limits, pool)
        parts.append(format_tool_response(text))
        executed += ran
        errors += failed
    return ToolTurn("\n".join(parts), executed, errors)


async def _execute_one(call: ToolCall, limits: SandboxLimits, pool: SandboxPool | None) -> tuple[str, int, int]:
    if call.error is not None:
        return f"error: {call.error}", 0, 1
    if call.name != TOOL_NAME:
        return f"error: unknown tool {call.name!r}; the only tool is {TOOL_NAME!r}", 0, 1
    code = call.arguments.get("code")
    if not isinstance(code, str) or not code.strip():
        return "error: the python tool needs a non-empty string argument 'code'", 0, 1
    res = await run_python(code, limits, pool)
    return res.as_observation(), 1, int(not res.ok)


@dataclass
class PythonToolEnv:
    """One trajectory in which the policy may call the ``python`` tool before it answers.

    A turn with tool calls runs them (at most ``max_calls_per_turn`` each turn, ``max_tool_calls`` in
    all: past that the episode ends as truncated) and returns their output as the observation; a turn
    without one is the answer, graded by the subclass's ``answer``. Subclasses set ``name`` and may
    check a task's answer field in ``check_task``.
    """

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    max_tool_calls: int = 50
    max_calls_per_turn: int = 4
    pool: SandboxPool | None = None
    name: str = "python_tool"

    def __post_init__(self) -> None:
        if self.max_tool_calls < 0 or self.max_calls_per_turn < 1:
            raise ValueError("max_tool_calls must be >= 0 and max_calls_per_turn >= 1")
        self._task: Task | None = None
        self._tool_calls = 0
        self._tool_errors = 0

    def check_task(self, task: Task) -> None:
        """Raise ValueError if ``task`` cannot be graded by this environment (default: any task can)."""

    async def answer(self, task: Task, action_text: str) -> StepResult:
        raise NotImplementedError

    async def reset(self, task: Task) -> None:
        check_task_env(self.name, task)
        self.check_task(task)
        self._task, self._tool_calls, self._tool_errors = task, 0, 0

    async def step(self, action_text: str) -> StepResult:
        task = require_task(self.name, self._task)
        calls = parse_tool_calls(action_text)
        if not calls:
            return await self.answer(task, action_text)
        if self._tool_calls >= self.max_tool_calls:
            return StepResult(None, True, 0.0, self._info(reason="tool_call_limit", truncated=True))
        turn = await execute_tool_calls(calls, self.limits, self.pool, self.max_calls_per_turn)
        self._tool_calls += len(calls)
        self._tool_errors += turn.errors
        return StepResult(turn.observation, False, 0.0, self._info())

    async def close(self) -> None:
        self._task = None

    def _info(self, **extra) -> dict:
        return {"tool_calls": self._tool_calls, "tool_errors": self._tool_errors, **extra}
