"""Online style-shift writing task (the paper's online-learning simulation).

The policy answers short writing prompts; a judge gives reward 1 iff the answer follows the
*currently preferred* style. The preference switches by phase (academic -> cute -> chuunibyou ->
classical by default) on a schedule of trainer steps, and the prompt never names the style: the
policy can only track it through the reward, which is what makes the task non-stationary and
shows how fast a critic (vs. a running-mean baseline) re-adapts after each switch.

Which step decides the style: ``task.meta["policy_step"]`` when the agent loop sets it (the
policy version that started the rollout), otherwise the shared ``StyleSchedule.current_step``
that the trainer advances with ``schedule.advance(step)``.

From a YAML config the env is built by ``make_env("style_shift", **env.kwargs)``, so it also
takes plain values: ``switch_every`` (+ ``styles``) instead of a ``StyleSchedule`` object and
``min_hits`` for the rule judge. ``make_demonstrations`` writes SFT conversations in all styles
(uniformly), so the SFT policy starts at ~25% reward under any preference and RL has to find it.

Every response ends the episode (single turn, no tools). A ``JudgeError`` propagates: an
unreachable judge is an infrastructure failure, and scoring it 0 would silently bias learning.
"""

from __future__ import annotations

import bisect
import random
import re
from typing import Sequence

from megatron_sao.envs.base import ListTaskSource, StepResult, Task, check_task_env, require_task
from megatron_sao.envs.style_judges import STYLES, OpenAICompatibleJudge, RuleBasedStyleJudge, StyleJudge
from megatron_sao.envs.tool_calls import answer_region

ENV_NAME = "style_shift"
SYSTEM_PROMPT = "You are a creative writer. Answer in one short paragraph (at most 120 words)."
# For the character-level CPU model every character is a token: the 76-character prompt above is
# ~40% of a demonstration. The CPU example passes this one (task_kwargs.system_prompt), and SFT
# uses the same task_kwargs so demonstrations and rollouts start with the same prompt.
SHORT_SYSTEM_PROMPT = "Write one short sentence."
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


def load_style_tasks(n: int = 256, seed: int = 0, prompts: Sequence[str] = WRITING_PROMPTS,
                     system_prompt: str | None = SYSTEM_PROMPT) -> ListTaskSource:
    """``n`` tasks drawn (seeded) from the writing prompts; the style is never in the prompt.

    ``system_prompt=None`` (or "") leaves the system message out.
    """
    if n < 1 or not prompts:
        raise ValueError("load_style_tasks needs n >= 1 and a non-empty prompt list")
    rng = random.Random(seed)
    head = [{"role": "system", "content": system_prompt}] if system_prompt else []
    tasks = []
    for i in range(n):
        prompt = prompts[rng.randrange(len(prompts))]
        tasks.append(Task(prompt_id=f"style/{seed}/{i}", env=ENV_NAME, answer=None,
                          messages=[*head, {"role": "user", "content": prompt}]))
    return ListTaskSource(tasks)


# Short answer templates per style, for SFT demonstrations. Each has 2-4 distinct markers of its own
# style and none of another (checked by the tests against RuleBasedStyleJudge(min_hits=2)), is ASCII
# (the char tokenizer has no other characters) and about 30-60 characters long, so that a whole
# demonstration fits the CPU model's 256 positions (~120 with SHORT_SYSTEM_PROMPT). The style is
# fixed by the first word or two, so that is where RL has to move probability mass after a switch.
# ``{t}`` is the prompt's topic word (see ``prompt_topic``); about half the templates use it, for
# some variety without making the tiny model's job much harder.
STYLE_TEMPLATES: dict[str, tuple[str, ...]] = {
    "academic": (
        "Furthermore, the evidence on the {t} is notably clear.",
        "Moreover, an empirical analysis of the {t} is needed.",
        "The evidence is weak; therefore, more analysis is needed.",
        "In conclusion, this essay finds the question notably open.",
        "Notably, the hypothesis holds; consequently, we agree.",
    ),
    "cute": (
        "Hehe~ the {t} is so fluffy! <3",
        "Yay! A sparkly {t} for my bunny ^_^",
        "Teehee, everything is kawaii today~",
        "Nya~ a fluffy nap is the best, uwu",
        "Yay, hehe! So sparkly and soft <3",
    ),
    "chuunibyou": (
        "My right eye burns; the {t} is my destiny!",
        "Mortals! The dark flame of the {t} shall awaken.",
        "The sealed power calls me from the abyss.",
        "Behold, the cursed blade is forbidden to mortals!",
        "My true power stirs; the dragon shall awaken!",
    ),
    "classical": (
        "Alas, thy {t} hath gone ere dawn.",
        "Verily, 'tis a fair {t}, I tell thee.",
        "Thou art weary, alas, and the night doth fall.",
        "Wherefore doth the wind weep o'er the hills?",
        "Henceforth, thou shalt rest, for 'tis late.",
    ),
}


def prompt_topic(prompt: str) -> str:
    """The prompt's last word, lower-cased ("... in a small town." -> "town"): its topic, roughly."""
    words = re.findall(r"[A-Za-z]+", prompt)
    return words[-1].lower() if words else "day"


def make_demonstrations(n: int, seed: int = 0, styles: Sequence[str] = STYLES,
                        prompts: Sequence[str] = WRITING_PROMPTS,
                        system_prompt: str | None = SYSTEM_PROMPT) -> list[list[dict]]:
    """``n`` SFT conversations: the task's messages (as ``load_style_tasks(n, seed, prompts,
    system_prompt)`` builds them, i.e. exactly what the policy sees) + one assistant answer.

    Each answer is in one style drawn uniformly from ``styles`` and adheres to it, and only to it,
    per ``RuleBasedStyleJudge(min_hits=2)``: the SFT policy then writes every style about equally
    often, so it starts at ~1/len(styles) reward whatever the preferred style is, and RL has to
    find (and, after each switch, re-find) the rewarded one.
    """
    styles = _check_styles(styles)
    tasks = load_style_tasks(n, seed, prompts, system_prompt)
    rng = random.Random(seed + 1_000_003)  # independent of the prompt stream
    demos = []
    for task in tasks:
        style = styles[rng.randrange(len(styles))]
        template = STYLE_TEMPLATES[style][rng.randrange(len(STYLE_TEMPLATES[style]))]
        # The topic is one word, so it adds at most one marker of another style, and every
        # template has at least two of its own: the answer stays in its style for any prompt.
        answer = template.format(t=prompt_topic(task.messages[-1]["content"]))
        demos.append([dict(m) for m in task.messages] + [{"role": "assistant", "content": answer}])
    return demos


def _check_styles(styles: Sequence[str]) -> list[str]:
    styles = list(styles)
    if not styles:
        raise ValueError("styles must be a non-empty list")
    unknown = [s for s in styles if s not in STYLES]
    if unknown:
        raise ValueError(f"unknown styles {unknown}; known styles: {list(STYLES)}")
    return styles


class StyleShiftEnv:
    """Single-turn writing env; reward 1 iff the judge says the response has the current style.

    Either pass objects (``schedule=``, ``judge=``) or, from a YAML ``env.kwargs``, plain values:
    ``switch_every=N`` (the style changes every N trainer steps, cycling through ``styles``,
    default ``STYLES``), ``min_hits`` for the default rule judge, or ``judge_url`` + ``judge_model``
    (+ ``judge_api_key_env``, None for no key) for an LLM judge behind an OpenAI-compatible endpoint.
    Giving both forms of the same thing is an error rather than a silent precedence rule. Default:
    ``StyleSchedule.every(100)``.
    """

    name = ENV_NAME

    def __init__(self, schedule: StyleSchedule | None = None, judge: StyleJudge | None = None, *,
                 switch_every: int | None = None, styles: Sequence[str] | None = None,
                 min_hits: int | None = None, judge_url: str | None = None, judge_model: str | None = None,
                 judge_api_key_env: str | None = "OPENAI_API_KEY") -> None:
        if judge_url is not None:  # an LLM judge behind an OpenAI-compatible endpoint (YAML: env.kwargs)
            if judge is not None or min_hits is not None:
                raise ValueError("StyleShiftEnv: judge_url selects the LLM judge; do not also give judge= or min_hits")
            if not judge_model:
                raise ValueError("StyleShiftEnv: judge_url needs judge_model (the served model's name)")
            judge = OpenAICompatibleJudge(judge_url, judge_model, api_key_env=judge_api_key_env)
        if schedule is not None and switch_every is not None:
            raise ValueError("StyleShiftEnv: give either schedule or switch_every, not both")
        if styles is not None and switch_every is None:
            raise ValueError("StyleShiftEnv: styles only applies with switch_every (a schedule names its own styles)")
        if judge is not None and min_hits is not None:
            raise ValueError("StyleShiftEnv: min_hits configures the default rule judge; it cannot apply to judge=")
        if switch_every is not None:
            schedule = StyleSchedule.every(int(switch_every), _check_styles(styles if styles is not None else STYLES))
        self.schedule = schedule if schedule is not None else StyleSchedule.every(100)
        self.judge = judge if judge is not None else RuleBasedStyleJudge(2 if min_hits is None else int(min_hits))
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
