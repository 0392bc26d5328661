"""Arithmetic chains with the sandboxed Python tool: 3-6 dependent calls, a broken chain visible in
the next tool result (the SmolLM2 counterpart of envs/toy_chain.py).

A task whose return a critic can read from the state. Each step needs the previous step's result::

    system     "Compute one step per Python call, e.g. <python>print(14*7)</python> ... \\boxed{...}"
    user       "Start with 14. Step 1: multiply by 7. Step 2: add 35. Step 3: subtract 18. What is the result?"
    assistant  "<python>print(14*7)</python>"     tool "<tool_response>\\n98\\n</tool_response>"
    assistant  "<python>print(98+35)</python>"    tool "<tool_response>\\n133\\n</tool_response>"
    assistant  "<python>print(133-18)</python>"   tool "<tool_response>\\n115\\n</tool_response>"
    assistant  "The answer is \\boxed{115}."         reward 1

The code runs in the sandbox (envs/sandbox.py) like every Python tool call here; the environment then
checks its printed value against the chain's next step. A call that prints anything else (an operand
or the previous result copied wrongly, two steps at once, several calls in one turn) gets
``BROKEN_MESSAGE`` instead of its output and breaks the chain: every later call gets it too, and the
reward is 0. Reward 1 iff every step was computed in order and the boxed answer is the final value.

Held-out split by content, as in arith_python: a chain belongs to ``eval`` iff a hash of its numbers
falls in the eval bucket, so no held-out chain is trained on whatever the seeds.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

from megatron_sao.envs.base import ListTaskSource, StepResult, Task, check_task_env, require_task
from megatron_sao.envs.chain_progress import ChainProgress, Step, chain_steps, demonstration_calls
from megatron_sao.envs.python_tool import execute_tool_calls
from megatron_sao.envs.sandbox import SandboxLimits, SandboxPool
from megatron_sao.envs.tool_calls import extract_boxed, format_tool_response, parse_tool_calls
from megatron_sao.envs.toy_tool import apply_op

ENV_NAME = "chain_python"
SPLITS = ("train", "eval")
EVAL_FRACTION = 0.2
BROKEN_MESSAGE = "error: that is not the next step of the chain"
SYSTEM_PROMPT = ("Compute one step per Python call, e.g. <python>print(14*7)</python>, read its output, "
                 "then answer with the final number as \\boxed{115}.")
WORDS = {"+": "add", "-": "subtract", "*": "multiply by"}
MAX_VALUE = 99_999


def _draw(rng: random.Random, n_steps: int) -> tuple[int, list[tuple[str, int]]]:
    """A start value and `n_steps` (op, operand) with every intermediate value in [0, MAX_VALUE]."""
    while True:
        start, steps = rng.randint(2, 99), []
        cur = start
        for _ in range(n_steps):
            op = rng.choice("+-*")
            b = rng.randint(2, 9) if op == "*" else rng.randint(10, 99)
            nxt = apply_op(cur, op, b)
            if not 0 <= nxt <= MAX_VALUE:
                break
            steps.append((op, b))
            cur = nxt
        if len(steps) == n_steps:
            return start, steps


def split_of(start: int, steps: list[tuple[str, int]]) -> str:
    """``eval`` or ``train`` by a stable hash of the chain's arithmetic (sha256, not the salted hash())."""
    key = f"{start}:" + ",".join(f"{op}{b}" for op, b in steps)
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2 ** 64
    return "eval" if bucket < EVAL_FRACTION else "train"


def question(start: int, steps: list[tuple[str, int]]) -> str:
    parts = [f"Start with {start}."] + [f"Step {i + 1}: {WORDS[op]} {b}." for i, (op, b) in enumerate(steps)]
    return " ".join(parts + ["What is the result?"])


def load_chain_tasks(path_or_spec: str | None = "train", n: int = 2000, seed: int = 0, min_steps: int = 3,
                     max_steps: int = 6, system_prompt: str = SYSTEM_PROMPT) -> ListTaskSource:
    """``n`` distinct chains of one split (``path_or_spec`` = ``train`` | ``eval``), deterministic per seed."""
    split = path_or_spec or "train"
    if split not in SPLITS:
        raise ValueError(f"chain_python: split must be one of {SPLITS} (env.train_data / env.eval_data), got {split!r}")
    if n < 1 or not 1 <= min_steps <= max_steps:
        raise ValueError(f"chain_python: need n >= 1 and 1 <= min_steps <= max_steps, got {n}, {min_steps}, "
                         f"{max_steps}")
    rng = random.Random(f"chain_python/{split}/{seed}")
    tasks, seen = [], set()
    for _ in range(200 * n):
        start, steps = _draw(rng, rng.randint(min_steps, max_steps))
        key = (start, tuple(steps))
        if key in seen or split_of(start, steps) != split:
            continue
        seen.add(key)
        final = chain_steps(start, steps)[-1][3]
        tasks.append(Task(prompt_id=f"chain/{split}/{seed}/{len(tasks)}", env=ENV_NAME, answer=str(final),
                          messages=[{"role": "system", "content": system_prompt},
                                    {"role": "user", "content": question(start, steps)}],
                          meta={"start": start, "steps": [list(s) for s in steps]}))
        if len(tasks) == n:
            return ListTaskSource(tasks)
    raise ValueError(f"chain_python: could not draw {n} distinct {split} chains")


def _steps(task: Task) -> list[Step]:
    return chain_steps(task.meta["start"], [tuple(s) for s in task.meta["steps"]])


def reference_actions(task: Task) -> list[str]:
    """The actions of a correct episode (the demonstrations' format): one call per step, then the answer."""
    steps = _steps(task)
    return [f"<python>print({a}{op}{b})</python>" for a, op, b, _ in steps] + \
        [f"The answer is \\boxed{{{steps[-1][3]}}}."]


@dataclass
class ChainPythonEnv:
    """The checked chain (envs/chain_progress.py) with the sandboxed Python tool."""

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    pool: SandboxPool | None = None
    max_extra_calls: int = 2  # calls beyond the chain's length before the episode is cut (truncated)
    name: str = ENV_NAME

    def __post_init__(self) -> None:
        self._task: Task | None = None
        self._progress: ChainProgress | None = None

    async def reset(self, task: Task) -> None:
        check_task_env(self.name, task)
        self._task, self._progress = task, ChainProgress(_steps(task), self.max_extra_calls)

    async def step(self, action_text: str) -> StepResult:
        task = require_task(self.name, self._task)
        progress = self._progress
        calls = parse_tool_calls(action_text)
        if calls:
            if progress.call_limit_reached():
                return StepResult(None, True, 0.0, progress.info(reason="tool_call_limit", truncated=True))
            expected = progress.next_step()
            if expected is not None and len(calls) == 1:  # a broken chain's calls do not run
                turn = await execute_tool_calls(calls, self.limits, self.pool, max_calls_per_turn=1)
                printed = turn.observation.removeprefix("<tool_response>\n").removesuffix("\n</tool_response>")
                if progress.record_call(1, turn.errors == 0 and printed.strip() == str(expected[3])):
                    return StepResult(turn.observation, False, 0.0, progress.info())
            else:
                progress.record_call(len(calls), correct=False)
            return StepResult(format_tool_response(BROKEN_MESSAGE), False, 0.0, progress.info())
        boxed = extract_boxed(action_text)
        if boxed is None:
            return StepResult(None, True, 0.0, progress.info(reason="no_tool_call_or_answer"))
        reward, reason = progress.answer(boxed.strip() == str(task.answer))
        return StepResult(None, True, reward, progress.info(reason=reason, pred=boxed))

    async def close(self) -> None:
        self._task = self._progress = None


def make_demonstrations(n: int, seed: int = 0, error_rate: float = 0.3, min_steps: int = 3, max_steps: int = 6,
                        system_prompt: str = SYSTEM_PROMPT) -> list[list[dict]]:
    """``n`` solved *training* chains for SFT, a fraction ``error_rate`` of them with one mistake
    (chain_progress.demonstration_calls); a call after the mistake gets ``BROKEN_MESSAGE``."""
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"chain_python: error_rate must be in [0, 1], got {error_rate}")
    rng = random.Random(f"chain_python/demos/{seed}")
    demos = []
    tasks = load_chain_tasks("train", n, seed + 7_919, min_steps, max_steps, system_prompt)
    for i in range(n):
        task = tasks[i]
        steps = _steps(task)
        calls, final = demonstration_calls(steps, rng, error_rate)
        msgs = [dict(m) for m in task.messages]
        for (a, op, b, broken), (*_, result) in zip(calls, steps):
            msgs += [{"role": "assistant", "content": f"<python>print({a}{op}{b})</python>"},
                     {"role": "tool", "content": format_tool_response(BROKEN_MESSAGE if broken else str(result))}]
        msgs.append({"role": "assistant", "content": f"The answer is \\boxed{{{final}}}."})
        demos.append(msgs)
    return demos
