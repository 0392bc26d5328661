"""Shared pieces of the agent endpoint's tests: tokenizers with real and Qwen3-shaped templates, a recording
engine, and an endpoint served on a loop of its own (the rollout driver's loop in a run)."""

from __future__ import annotations

import asyncio
import gzip
import shutil
import threading
from pathlib import Path

from megatron_sao.rollout.engines.protocol import GenerationResult
from megatron_sao.tokenizers import build_char_tokenizer

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "smollm2_tokenizer"

# Qwen3's tool layout (our own template, written to behave like Qwen3's at the places the endpoint depends
# on): a "# Tools" system section listing each tool as JSON, <tool_call> blocks after an assistant's text,
# consecutive tool results grouped in one user turn of <tool_response> blocks.
QWEN3_TOOLS_TEMPLATE = (
    "{%- if tools -%}{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\n<tools>' -}}{%- for t in tools -%}{{- '\\n' -}}{{- t | tojson -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nReturn <tool_call></tool_call> blocks.<|im_end|>\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' + m.content -}}"
    "{%- for c in m.tool_calls or [] -%}{%- if m.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{%- set f = c.function if c.function else c -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' -}}"
    "{%- if f.arguments is string -%}{{- f.arguments -}}{%- else -%}{{- f.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}{%- endfor -%}{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
BASH_TOOL = {"type": "function", "function": {"name": "bash", "description": "Execute a bash command",
                                              "parameters": {"type": "object",
                                                             "properties": {"command": {"type": "string"}},
                                                             "required": ["command"]}}}


def qwen3_tools_tokenizer():
    tok = build_char_tokenizer(("<|im_start|>", "<|im_end|>"))
    tok.chat_template = QWEN3_TOOLS_TEMPLATE
    return tok


def smollm2_tokenizer(tmp: Path):
    """SmolLM2-135M-Instruct's real tokenizer and ChatML template (tests/fixtures)."""
    from transformers import AutoTokenizer

    d = tmp / "smollm2_tok"
    d.mkdir(exist_ok=True)
    (d / "tokenizer.json").write_bytes(gzip.decompress((FIXTURE / "tokenizer.json.gz").read_bytes()))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(FIXTURE / name, d / name)
    return AutoTokenizer.from_pretrained(str(d))


class ScriptedTextEngine:
    """Answers the n-th generate call with ``replies[n]`` encoded plus the formatter's stop id; records every
    prompt and result. ``fail_on``: that call raises (a dead server)."""

    def __init__(self, tok, stop_id: int, replies: list[str], fail_on: int | None = None, version: int = 0):
        self.tok, self.stop_id, self.replies, self.fail_on, self.version = tok, stop_id, replies, fail_on, version
        self.prompts: list[list[int]] = []
        self.results: list[GenerationResult] = []

    async def generate(self, prompt_ids, sampling) -> GenerationResult:
        n = len(self.prompts)
        self.prompts.append(list(prompt_ids))
        if n == self.fail_on:
            raise ConnectionError("engine went away")
        ids = (self.tok.encode(self.replies[min(n, len(self.replies) - 1)], add_special_tokens=False)
               + [self.stop_id])[:sampling.max_new_tokens]
        lps = [-0.1 - 0.01 * i for i in range(len(ids))]
        r = GenerationResult(ids, lps, [self.version] * len(ids), "stop" if ids[-1] == self.stop_id else "length")
        self.results.append(r)
        return r


class RecordingEngine:
    """A real engine whose every result is kept, to compare trajectories with what it sampled."""

    def __init__(self, engine):
        self.engine = engine
        self.prompts: list[list[int]] = []
        self.results: list[GenerationResult] = []

    async def generate(self, prompt_ids, sampling) -> GenerationResult:
        self.prompts.append(list(prompt_ids))
        r = await self.engine.generate(prompt_ids, sampling)
        self.results.append(r)
        return r


class LoopThread:
    """An event loop in a thread: the endpoint serves there while the test's OpenAI client blocks here."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn, *args, **kwargs):
        async def go():
            return fn(*args, **kwargs)
        return self.run(go())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
