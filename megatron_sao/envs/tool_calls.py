"""Tool-call and final-answer syntax shared by the text environments (math, coding).

Tool calls (Qwen3 / Hermes style)::

    <tool_call>{"name": "python", "arguments": {"code": "print(1+1)"}}</tool_call>

and a relaxed form that small models find easier to produce::

    <python>print(1+1)</python>

A ``<tool_call>`` whose closing tag is missing at the very end of the text is accepted (the
rollout engine may stop generation on ``</tool_call>`` without returning the stop string).
Malformed calls are *not* exceptions: they come back as ``ToolCall`` objects with ``error`` set,
and the environment reports the error to the policy as the observation, so the policy can learn
to fix its syntax instead of the rollout crashing.

Final answers: the last ``\\boxed{...}`` (math) or the last fenced ```python block (coding),
looked for after the last ``</think>`` when the model emits a reasoning block.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_PYTHON_TAG_RE = re.compile(r"<python>(.*?)</python>", re.DOTALL)
_FENCE_RE = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)
_THINK_END = "</think>"


@dataclass
class ToolCall:
    """One parsed tool call; ``error`` is set (and name/arguments may be empty) if malformed."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _parse_json_call(body: str) -> ToolCall:
    raw = body.strip()
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCall(name="", raw=raw, error=f"tool call is not valid JSON ({e.msg} at char {e.pos})")
    if not isinstance(obj, dict):
        return ToolCall(name="", raw=raw, error="tool call must be a JSON object with 'name' and 'arguments'")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(name="", raw=raw, error="tool call is missing a string 'name'")
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some templates serialise arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCall(name=name, raw=raw, error="tool call 'arguments' is a string that is not valid JSON")
    if not isinstance(args, dict):
        return ToolCall(name=name, raw=raw, error="tool call 'arguments' must be a JSON object")
    return ToolCall(name=name, arguments=args, raw=raw)


def json_tool_calls(text: str) -> list[tuple[int, int, ToolCall]]:
    """Every ``<tool_call>{json}</tool_call>`` block of ``text`` (the last one may lack its closing tag)
    as (start, end, call): the agent endpoint turns the well-formed ones into OpenAI tool calls."""
    if not isinstance(text, str):
        raise TypeError(f"json_tool_calls expects str, got {type(text).__name__}")
    return [(m.start(), m.end(), _parse_json_call(m.group(1))) for m in _TOOL_CALL_RE.finditer(text)]


def parse_tool_calls(text: str) -> list[ToolCall]:
    """All tool calls in ``text``, in order of appearance (both syntaxes)."""
    if not isinstance(text, str):
        raise TypeError(f"parse_tool_calls expects str, got {type(text).__name__}")
    found: list[tuple[int, ToolCall]] = []
    for m in _TOOL_CALL_RE.finditer(text):
        found.append((m.start(), _parse_json_call(m.group(1))))
    for m in _PYTHON_TAG_RE.finditer(text):
        found.append((m.start(), ToolCall(name="python", arguments={"code": m.group(1)}, raw=m.group(0))))
    found.sort(key=lambda p: p[0])
    return [c for _, c in found]


def answer_region(text: str) -> str:
    """The part of a turn that may hold the final answer: after the last ``</think>``, if any."""
    idx = text.rfind(_THINK_END)
    return text if idx < 0 else text[idx + len(_THINK_END):]


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None if there is none."""
    region = answer_region(text)
    start = region.rfind("\\boxed")
    while start >= 0:
        i = start + len("\\boxed")
        while i < len(region) and region[i] == " ":
            i += 1
        if i < len(region) and region[i] == "{":
            depth, j = 0, i
            while j < len(region):
                if region[j] == "{":
                    depth += 1
                elif region[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return region[i + 1:j]
                j += 1
        start = region.rfind("\\boxed", 0, start)  # unbalanced: try an earlier one
    return None


def extract_python_block(text: str) -> str | None:
    """Body of the last fenced ```python block, or None."""
    blocks = _FENCE_RE.findall(answer_region(text))
    return blocks[-1] if blocks else None


def format_tool_response(content: str) -> str:
    """Observation text for one tool result; the agent loop puts it in the tool role."""
    return f"<tool_response>\n{content}\n</tool_response>"
