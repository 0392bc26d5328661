"""OpenAI function calling in and out of the model's chat template.

In: a request's ``tools`` and the history's assistant ``tool_calls`` and ``tool`` results become what the
template renders. A template that renders tools itself (Qwen3's: a ``# Tools`` system section,
``<tool_call>`` blocks in assistant turns, ``<tool_response>`` in a user turn) gets them as template
variables, found out by a probe render at start-up, as the chat formatter finds its closing. A template
that does not (SmolLM2's plain ChatML, the demo's char template) gets the same Hermes layout written
into the messages: the tool list appended to the system message (one is added when there is none), each
call as a ``<tool_call>`` block after the assistant's text, each result wrapped in ``<tool_response>``.
So the model sees one tool syntax whichever template it has, and the parser below reads one.

Out: the model's text becomes ``content`` and ``tool_calls``: every well-formed ``<tool_call>{"name",
"arguments"}</tool_call>`` block is a call (arguments serialised as a JSON string, as OpenAI sends them)
and is cut from the content; a malformed block stays in the content, so the harness sees what the model
wrote (mini-swe-agent then answers with its format-error message, which the model can learn from).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from megatron_sao.envs.tool_calls import json_tool_calls

_PROBE_TOOL = "sao_probe_tool_5d2e"
_PROBE_CALL = "sao_probe_call_8b41"
_PROBE_USER = {"role": "user", "content": "probe"}


def _tool_spec(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": "probe",
                                             "parameters": {"type": "object", "properties": {}}}}


def _call_block(call: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": call["name"], "arguments": call["arguments"]}) + "\n</tool_call>"


def tools_section(tools: list[dict]) -> str:
    """The Hermes tool section (Qwen3's wording) for a template without tool support."""
    lines = "\n".join(json.dumps(t) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{lines}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


class ToolFormat:
    """How tools reach one chat template, and how tool calls come back out of the model's text."""

    def __init__(self, formatter: Any) -> None:
        self.formatter = formatter
        self.native = self._renders_tools()

    def _renders_tools(self) -> bool:
        f = self.formatter
        try:
            listed = _PROBE_TOOL in f.render([_PROBE_USER], add_generation_prompt=True, tools=[_tool_spec(_PROBE_TOOL)])
            fn = {"type": "function", "id": "c0", "function": {"name": _PROBE_CALL, "arguments": {}}}
            call = {"role": "assistant", "content": "", "tool_calls": [fn]}
            called = _PROBE_CALL in f.render([_PROBE_USER, call], add_generation_prompt=False,
                                             tools=[_tool_spec(_PROBE_CALL)])
        except Exception:  # a template that raises on tool fields does not render them
            return False
        return listed and called

    # ------------------------------------------------------------------ in
    def template_messages(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], dict]:
        """(messages as the template takes them, extra template variables) for canonical ``messages``."""
        out = [self._message(m) for m in messages]
        if not tools:
            return out, {}
        if self.native:
            return out, {"tools": tools}
        section = tools_section(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" + section) if out[0]["content"] else section}
        else:
            out.insert(0, {"role": "system", "content": section})
        return out, {}

    def continuation(self, messages: list[dict]) -> list[dict]:
        """Template messages for what follows an assistant turn (tool results, a user message)."""
        return [self._message(m) for m in messages]

    def _message(self, m: dict) -> dict:
        role, content = m["role"], m["content"]
        if role == "assistant" and m.get("tool_calls"):
            if self.native:
                calls = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                         for c in m["tool_calls"]]
                return {"role": "assistant", "content": content, "tool_calls": calls}
            blocks = "\n".join(_call_block(c) for c in m["tool_calls"])
            return {"role": "assistant", "content": (content + "\n" + blocks) if content else blocks}
        if role == "tool" and not self.native:
            return {"role": "tool", "content": f"<tool_response>\n{content}\n</tool_response>"}
        return {"role": role, "content": content}

    # ------------------------------------------------------------------ out
    @staticmethod
    def parse(text: str) -> tuple[str, list[dict]]:
        """(content, OpenAI tool_calls) of the model's text (module docstring)."""
        calls, kept, pos = [], [], 0
        for start, end, call in json_tool_calls(text):
            if not call.ok:
                continue  # stays in the content
            kept.append(text[pos:start])
            pos = end
            calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                          "function": {"name": call.name, "arguments": json.dumps(call.arguments)}})
        kept.append(text[pos:])
        content = "".join(kept).strip() if calls else text
        return content, calls
