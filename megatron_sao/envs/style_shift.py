"""Online style-shift writing task (the paper's online-learning simulation).

The policy answers short writing prompts; a judge gives reward 1 iff the answer follows the
*currently preferred* style. The preference switches by phase (academic -> cute -> chuunibyou ->
classical by default) on a schedule of trainer steps, and the prompt never names the style: the
policy can only track it through the reward, which is what makes the task non-stationary and
shows how fast a critic (vs. a running-mean baseline) re-adapts after each switch.

Which step decides the style: ``task.meta["policy_step"]`` when the agent loop sets it (the
policy version that started the rollout), otherwise the shared ``StyleSchedule.current_step``
that the trainer advances with ``schedule.advance(step)``.

Every response ends the episode (single turn, no tools). A ``JudgeError`` propagates: an
unreachable judge is an infrastructure failure, and scoring it 0 would silently bias learning.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field
from typing import Sequence

from megatron_sao.envs.base import ListTaskSource, StepResult, Task, check_task_env, require_task
from megatron_sao.envs.style_judges import STYLES, RuleBasedStyleJudge, StyleJudge
from megatron_sao.envs.tool_calls import answer_region

ENV_NAME = "style_shift"
SYSTEM_PROMPT = "You are a creative writer. Answer in one short paragraph (at most 120 words)."
WRITING_PROMPTS = (
    "Describe a rainy afternoon in a small town.",
    "Write a note thanking a friend for a borrowed book.",
    "Explain why the sky looks blue.",
    "Describe your favourite breakfast.",
    "Write the opening of a story about a lost key.",
    "Describe a cat watching birds through a window.",
    "Give advice to someone starting to learn the piano.",
    "Describe the first snowfall of the year.",
    "Write a short review of an imaginary restaurant.",
    "Explain how a bicycle stays upright.",
    "Describe a night market.",
    "Write a message announcing a team's victory.",
    "Describe an old lighthouse by the sea.",
    "Explain why people enjoy gardening.",
    "Write a farewell to a summer holiday.",
    "Describe a train journey through the mountains.",
)


class StyleSchedule:
    """Preferred style as a function of the trainer step.

    ``StyleSchedule([(0, "academic"), (200, "cute")])`` switches at step 200;
    ``StyleSchedule.every(100)`` cycles through ``STYLES`` every 100 steps.
    """

    def __init__(self, phases: Sequence[tuple[int, str]], period: int | None = None) -> None:
        phases = [(int(s), str(st)) for s, st in phases]
        if not phases:
            raise ValueError("StyleSchedule needs at least one (start_step, style) phase")
        if phases[0][0] != 0:
            raise ValueError(f"the first phase must start at step 0, got {phases[0][0]}")
        starts = [s for s, _ in phases]
        if any(b <= a for a, b in zip(starts, starts[1:])):
            raise ValueError(f"phase start steps must be strictly increasing, got {starts}")
        for _, st in phases:
            if st not in STYLES:
                raise ValueError(f"unknown style {st!r}; known styles: {list(STYLES)}")
        self._starts = starts
        self._styles = [st for _, st in phases]
        self._period = period  # set by every(): phases repeat with this many steps per phase
        self.current_step = 0

    @classmethod
    def every(cls, n_steps: int, styles: Sequence[str] = STYLES) -> "StyleSchedule":
        if n_steps < 1:
            raise ValueError(f"n_steps must be >= 1, got {n_steps}")
        return cls([(i * n_steps, s) for i, s in enumerate(styles)], period=n_steps)

    def phase_at(self, step: int) -> int:
        """Index of the phase in effect at ``step`` (keeps counting when a periodic schedule wraps)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self._period is not None:
            return step // self._period
        return bisect.bisect_right(self._starts, step) - 1

    def style_at(self, step: int) -> str:
        return self._styles[self.phase_at(step) % len(self._styles)]

    def advance(self, step: int) -> None:
        """Called by the trainer after each update; steps never go backwards."""
        if step < self.current_step:
            raise ValueError(f"schedule step cannot go back from {self.current_step} to {step}")
        self.current_step = step


def load_style_tasks(n: int = 256, seed: int = 0, prompts: Sequence[str] = WRITING_PROMPTS) -> ListTaskSource:
    """``n`` tasks drawn (seeded) from the writing prompts; the style is never in the prompt."""
    if n < 1 or not prompts:
        raise ValueError("load_style_tasks needs n >= 1 and a non-empty prompt list")
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        prompt = prompts[rng.randrange(len(prompts))]
        tasks.append(Task(prompt_id=f"style/{seed}/{i}", env=ENV_NAME, answer=None,
                          messages=[{"role": "system", "content": SYSTEM_PROMPT},
                                    {"role": "user", "content": prompt}]))
    return ListTaskSource(tasks)


@dataclass
class StyleShiftEnv:
    """Single-turn writing env; reward 1 iff the judge says the response has the current style."""

    schedule: StyleSchedule = field(default_factory=lambda: StyleSchedule.every(100))
    judge: StyleJudge = field(default_factory=RuleBasedStyleJudge)
    name: str = ENV_NAME

    def __post_init__(self) -> None:
        self._task: Task | None = None

    async def reset(self, task: Task) -> None:
        check_task_env(self.name, task)
        self._task = task

    async def step(self, action_text: str) -> StepResult:
        task = require_task(self.name, self._task)
        step = task.meta.get("policy_step", self.schedule.current_step)
        style = self.schedule.style_at(int(step))
        info = {"style": style, "phase": self.schedule.phase_at(int(step)), "step": int(step)}
        response = answer_region(action_text).strip()
        if not response:
            return StepResult(None, True, 0.0, {**info, "reason": "empty_response"})
        prompt = next((m["content"] for m in task.messages if m.get("role") == "user"), "")
        ok = await self.judge.judge(prompt, response, style)
        return StepResult(None, True, float(ok), {**info, "reason": "judged"})

    async def close(self) -> None:
        self._task = None
