"""OpenAI chat messages in one canonical form, so "the harness sent this turn back unchanged" is an equality.

A harness echoes the assistant messages it received with whatever its client library adds (litellm
adds ``function_call: None``, ``refusal``, ``provider_specific_fields``...; tool-call ids and the JSON
spelling of arguments vary), and it may send content as a list of parts. The canonical form keeps what a
chat template can render and nothing else:

    {"role", "content": str, ["tool_calls": [{"name", "arguments"}]], ["tool_call_id"], ["name"]}

with ``arguments`` parsed from JSON when it is a JSON object (the template needs a mapping, and two
spellings of one object compare equal) and kept as the string otherwise. Tool-call ids are dropped from
assistant messages (a client may re-number them; no template renders them) and kept on tool results.
"""

from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(ValueError):
    """A request the endpoint refuses (HTTP 400, the message names the field)."""


def flatten_content(content: Any, where: str) -> str:
    """Text of a message's content: a string, None (""), or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, p in enumerate(content):
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, dict) and p.get("type") in ("text", "input_text", "output_text") \
                    and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise RequestError(f"{where}.content[{i}]: only text parts are supported, got {kind!r}")
        return "".join(parts)
    raise RequestError(f"{where}.content must be a string, null or a list of text parts")


def _arguments(raw: Any, where: str) -> Any:
    if isinstance(raw, dict):
        return raw
    if raw is None:
        return {}
    if not isinstance(raw, str):
        raise RequestError(f"{where}.function.arguments must be a JSON string")
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError:
        return raw  # kept verbatim: the model wrote it, the harness echoes it
    return parsed if isinstance(parsed, dict) else raw


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be a list")
    out = []
    for j, c in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{w} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}")
        out.append({"name": fn["name"], "arguments": _arguments(fn.get("arguments"), w)})
    return out


def canonical_message(m: Any, i: int) -> dict:
    """The canonical form of ``messages[i]`` (module docstring); RequestError names what is wrong."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise RequestError(f"{where} must be an object")
    role = m.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role must be one of {ROLES}, got {role!r}")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role,
                           "content": flatten_content(m.get("content"), where)}
    if role == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = _tool_calls(m["tool_calls"], where)
    if role == "tool":
        if m.get("tool_call_id") is not None:
            out["tool_call_id"] = str(m["tool_call_id"])
    if isinstance(m.get("name"), str) and m["name"]:
        out["name"] = m["name"]
    return out


def canonical_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    return [canonical_message(m, i) for i, m in enumerate(messages)]


def continues(history: list[dict], messages: list[dict]) -> list[dict] | None:
    """The messages that extend ``history`` (which ends with an assistant turn), or None when ``messages``
    is not ``history`` unchanged plus new messages that are not the assistant's (a rewritten history)."""
    n = len(history)
    if len(messages) <= n or messages[:n] != history:
        return None
    tail = messages[n:]
    return None if any(m["role"] == "assistant" for m in tail) else tail
