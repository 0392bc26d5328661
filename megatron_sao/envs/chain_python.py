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
from megatron_sao.envs.python_tool import execute_tool_calls
from megatron_sao.envs.sandbox import SandboxLimits, SandboxPool
from megatron_sao.envs.tool_calls import extract_boxed, format_tool_response, parse_tool_calls
from megatron_sao.envs.toy_tool import _perturb  # one digit changed: the demonstrations' mistake, as toy_chain's

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
            nxt = cur + b if op == "+" else cur - b if op == "-" else cur * b
            if not 0 <= nxt <= MAX_VALUE:
                break
            steps.append((op, b))
            cur = nxt
        if len(steps) == n_steps:
            return start, steps


def chain_values(start: int, steps: list[tuple[str, int]]) -> list[tuple[int, str, int, int]]:
    """(a, op, b, result) of every step of the correct chain."""
    out, cur = [], start
    for op, b in steps:
        nxt = cur + b if op == "+" else cur - b if op == "-" else cur * b
        out.append((cur, op, b, nxt))
        cur = nxt
    return out


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
        final = chain_values(start, steps)[-1][3]
        tasks.append(Task(prompt_id=f"chain/{split}/{seed}/{len(tasks)}", env=ENV_NAME, answer=str(final),
                          messages=[{"role": "system", "content": system_prompt},
                                    {"role": "user", "content": question(start, steps)}],
                          meta={"start": start, "steps": [list(s) for s in steps]}))
        if len(tasks) == n:
            return ListTaskSource(tasks)
    raise ValueError(f"chain_python: could not draw {n} distinct {split} chains")


def _steps(task: Task) -> list[tuple[int, str, int, int]]:
    return chain_values(task.meta["start"], [tuple(s) for s in task.meta["steps"]])


def reference_actions(task: Task) -> list[str]:
    """The actions of a correct episode (the demonstrations' format): one call per step, then the answer."""
    steps = _steps(task)
    return [f"<python>print({a}{op}{b})</python>" for a, op, b, _ in steps] + \
        [f"The answer is \\boxed{{{steps[-1][3]}}}."]


@dataclass
class ChainPythonEnv:
    """The checked chain with the sandboxed Python tool."""

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    pool: SandboxPool | None = None
    max_extra_calls: int = 2  # calls beyond the chain's length before the episode is cut (truncated)
    name: str = ENV_NAME

    def __post_init__(self) -> None:
        self._task: Task | None = None
        self._done = self._calls = 0
        self._broken = False

    async def reset(self, task: Task) -> None:
        check_task_env(self.name, task)
        self._task, self._done, self._calls, self._broken = task, 0, 0, False

    async def step(self, action_text: str) -> StepResult:
        task = require_task(self.name, self._task)
        steps = _steps(task)
        calls = parse_tool_calls(action_text)
        if calls:
            if self._calls >= len(steps) + self.max_extra_calls:
                return StepResult(None, True, 0.0, self._info(reason="tool_call_limit", truncated=True))
            self._calls += len(calls)
            if not self._broken and len(calls) == 1 and self._done < len(steps):
                turn = await execute_tool_calls(calls, self.limits, self.pool, max_calls_per_turn=1)
                printed = turn.observation.removeprefix("<tool_response>\n").removesuffix("\n</tool_response>")
                if turn.errors == 0 and printed.strip() == str(steps[self._done][3]):
                    self._done += 1
                    return StepResult(turn.observation, False, 0.0, self._info())
            self._broken = True
            return StepResult(format_tool_response(BROKEN_MESSAGE), False, 0.0, self._info())
        boxed = extract_boxed(action_text)
        if boxed is None:
            return StepResult(None, True, 0.0, self._info(reason="no_tool_call_or_answer"))
        complete = self._done == len(steps) and not self._broken
        ok = complete and boxed.strip() == str(task.answer)
        reason = "correct" if ok else ("broken_chain" if self._broken else "incomplete" if not complete else "wrong")
        return StepResult(None, True, float(ok), self._info(reason=reason, pred=boxed))

    async def close(self) -> None:
        self._task = None

    def _info(self, **extra) -> dict:
        return {"tool_calls": self._calls, "steps_done": self._done, "broken": self._broken, **extra}


def make_demonstrations(n: int, seed: int = 0, error_rate: float = 0.3, min_steps: int = 3, max_steps: int = 6,
                        system_prompt: str = SYSTEM_PROMPT) -> list[list[dict]]:
    """``n`` solved *training* chains for SFT; with probability ``error_rate`` one mistake at a uniform
    step or in the answer. A wrong call (an operand copied wrongly) gets ``BROKEN_MESSAGE``; the
    demonstration then goes on with the value it believes it got, every later call answered with the
    message too, and answers with that belief (reward 0), as the env plays it out. So a failed
    episode's states after its mistake are as many as before it on average, and all of them show it."""
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"chain_python: error_rate must be in [0, 1], got {error_rate}")
    rng = random.Random(f"chain_python/demos/{seed}")
    demos = []
    tasks = load_chain_tasks("train", n, seed + 7_919, min_steps, max_steps, system_prompt)
    for i in range(n):
        task = tasks[i]
        steps = _steps(task)
        err = rng.randrange(len(steps) + 1) if rng.random() < error_rate else -1
        msgs, belief, broken = [dict(m) for m in task.messages], task.meta["start"], False
        for k, (_, op, b, result) in enumerate(steps):
            a = belief
            if k == err:
                a, b = (_perturb(rng, a), b) if rng.random() < 0.5 else (a, _perturb(rng, b))
                broken = True
            belief = a + b if op == "+" else a - b if op == "-" else a * b
            msgs += [{"role": "assistant", "content": f"<python>print({a}{op}{b})</python>"},
                     {"role": "tool", "content": format_tool_response(BROKEN_MESSAGE if broken else str(result))}]
        final = _perturb(rng, belief) if err == len(steps) else belief
        msgs.append({"role": "assistant", "content": f"The answer is \\boxed{{{final}}}."})
        demos.append(msgs)
    return demos
