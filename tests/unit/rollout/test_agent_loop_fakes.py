"""Shared fakes for the agent-loop and chat tests (this module holds no tests).

The boundary mocks: a scripted rollout engine (engine_fixtures.ScriptedEngine, re-exported here: emits
chosen token ids with log-probs and versions, and can abort, fail or delay) and small environments, plus
two Qwen3-shaped chat templates written over the char tokenizer (a real Qwen3 tokenizer cannot be
downloaded here).
"""

from __future__ import annotations

import asyncio

from megatron_sao.envs.base import StepResult, Task
from megatron_sao.tokenizers import build_char_tokenizer
from tests.engine_fixtures import ScriptedEngine, lp  # noqa: F401 (the agent-loop tests take them from here)

QWEN_SPECIALS = ("<|im_start|>", "<|im_end|>")

# The plain <|im_start|>role\n...<|im_end|>\n shape; tool replies wrapped as Qwen3 does.
QWEN_SHAPE_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Qwen3's quirks: the *last* assistant message after the last user query gets an empty think block
# (so render([.., a]) is not a prefix of render([.., a, tool])), consecutive tool messages share one
# user turn, and enable_thinking=False appends an empty think block to the generation prompt.
QWEN3_QUIRKS_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' or m.role == 'system' -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- if loop.index0 > ns.last_query and loop.last -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + m.content -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}{%- endif -%}"
)


def qwen_shape_tokenizer(template: str = QWEN_SHAPE_TEMPLATE):
    tok = build_char_tokenizer(QWEN_SPECIALS)
    tok.chat_template = template
    return tok


class CountingEnv:
    """Replies ``r<k>`` to the k-th action; done with ``reward`` after ``done_after`` steps.

    ``raise_on_step`` makes that step raise; ``truncated`` marks the final step as the env's own cut;
    ``delay`` sleeps in every step (to order episodes by finish time). Records every action text.
    """

    name = "counting"

    def __init__(self, done_after: int = 3, reward: float = 1.0, raise_on_step: int | None = None,
                 truncated: bool = False, delay: float = 0.0) -> None:
        self.done_after, self.reward, self.raise_on_step = done_after, reward, raise_on_step
        self.truncated, self.delay = truncated, delay
        self.actions: list[str] = []
        self.closed = False
        self.task: Task | None = None

    async def reset(self, task: Task) -> None:
        self.task, self.actions = task, []

    async def step(self, action_text: str) -> StepResult:
        self.actions.append(action_text)
        k = len(self.actions)
        await asyncio.sleep(self.delay)
        if self.raise_on_step == k:
            raise RuntimeError(f"tool crashed on step {k}")
        if k >= self.done_after:
            info = {"truncated": True} if self.truncated else {"tool_calls": k}
            return StepResult(None, True, 0.0 if self.truncated else self.reward, info)
        return StepResult(f"r{k}", False)

    async def close(self) -> None:
        self.closed = True


def task(i: int = 0, content: str = "3*4") -> Task:
    return Task(prompt_id=f"p{i}", messages=[{"role": "user", "content": content}], answer=None, env="counting")
