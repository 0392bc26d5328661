"""The ``python`` tool shared by the math and coding environments: tool calls -> sandbox -> text."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_sao.envs.sandbox import SandboxLimits, SandboxPool, run_python
from megatron_sao.envs.tool_calls import ToolCall, format_tool_response

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
