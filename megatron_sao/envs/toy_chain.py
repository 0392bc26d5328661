"""Calculator chains for the toy model: 3-6 dependent calls, a broken chain visible in the next tool result.

A task whose return a critic can read from the state. The question is a chain of `min_ops..max_ops`
operations evaluated left to right (toy_tool's format, ``"14*3+5-2"``); the model calls the
calculator once per step, each call starting from the previous result::

    user       "14*3+5-2"
    assistant  "<c>14*3</c>"    tool "42"
    assistant  "<c>42+5</c>"    tool "47"
    assistant  "<c>47-2</c>"    tool "45"
    assistant  "=45"            reward 1

The calculator holds the chain: a call that is not the chain's next step (the previous result or
the operand copied wrongly, a wrong operator, a malformed call, a call past the last step) answers
``ERR`` and breaks the chain, and every later call answers ``ERR`` too. So a mistake shows in the
tool result that follows it, and from then on the episode's return (0) is plain in the state.
Reward 1 iff every step was called correctly and the answer is the chain's final value.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from megatron_sao.envs.base import StepResult, Task, check_task_env, require_task
from megatron_sao.envs.toy_tool import ANSWER_RE, _perturb, _sample_chain, apply_op, evaluate, question_text

ENV_NAME = "toy_chain"
BROKEN = "ERR"


def chain_steps(nums: list[int], ops: list[str]) -> list[tuple[int, str, int, int]]:
    """(a, op, b, result) of every step of the correct chain."""
    out, cur = [], nums[0]
    for op, b in zip(ops, nums[1:]):
        nxt = apply_op(cur, op, b)
        out.append((cur, op, b, nxt))
        cur = nxt
    return out


class ToyChainTasks:
    """``n`` seeded chains of ``min_ops..max_ops`` steps (uniform), identical for identical arguments."""

    def __init__(self, n: int, seed: int = 0, min_ops: int = 3, max_ops: int = 6) -> None:
        if n < 1:
            raise ValueError(f"toy_chain: n must be >= 1, got {n}")
        if not 1 <= min_ops <= max_ops:
            raise ValueError(f"toy_chain: need 1 <= min_ops <= max_ops, got {min_ops}, {max_ops}")
        rng = random.Random(f"toy_chain/{seed}")
        self._tasks = []
        for i in range(n):
            nums, ops = _sample_chain(rng, rng.randint(min_ops, max_ops))
            self._tasks.append(Task(prompt_id=f"toy_chain/{seed}/{i}", env=ENV_NAME, answer=evaluate(nums, ops),
                                    messages=[{"role": "user", "content": question_text(nums, ops)}],
                                    meta={"n_ops": len(ops), "nums": nums, "ops": ops}))

    def __len__(self) -> int:
        return len(self._tasks)

    def __getitem__(self, i: int) -> Task:
        return self._tasks[i]


def load_toy_chain_tasks(n: int = 1000, seed: int = 0, min_ops: int = 3, max_ops: int = 6) -> ToyChainTasks:
    return ToyChainTasks(n, seed, min_ops, max_ops)


def reference_actions(task: Task) -> list[str]:
    """The actions of a correct episode: every step's call, then the answer."""
    steps = chain_steps(task.meta["nums"], task.meta["ops"])
    return [f"<c>{a}{op}{b}</c>" for a, op, b, _ in steps] + [f"={steps[-1][3]}"]


@dataclass
class ToyChainEnv:
    """The checked calculator chain (deterministic, in-process)."""

    max_extra_calls: int = 2  # calls beyond the chain's length before the episode is cut (truncated)
    name: str = ENV_NAME

    def __post_init__(self) -> None:
        self._task: Task | None = None
        self._done = 0
        self._calls = 0
        self._broken = False

    async def reset(self, task: Task) -> None:
        check_task_env(self.name, task)
        self._task, self._done, self._calls, self._broken = task, 0, 0, False

    async def step(self, action_text: str) -> StepResult:
        task = require_task(self.name, self._task)
        steps = chain_steps(task.meta["nums"], task.meta["ops"])
        text = action_text.strip()
        if text.startswith("<c>"):
            if self._calls >= len(steps) + self.max_extra_calls:
                return StepResult(None, True, 0.0, self._info(reason="tool_call_limit", truncated=True))
            self._calls += 1
            inner = text[3:-4] if text.endswith("</c>") else text[3:]
            if not self._broken and self._done < len(steps):
                a, op, b, result = steps[self._done]
                if inner == f"{a}{op}{b}":
                    self._done += 1
                    return StepResult(str(result), False, 0.0, self._info())
            self._broken = True
            return StepResult(BROKEN, False, 0.0, self._info())
        m = ANSWER_RE.fullmatch(text)
        if m is None:
            return StepResult(None, True, 0.0, self._info(reason="no_tool_call_or_answer"))
        value = int(m.group(1))
        complete = self._done == len(steps) and not self._broken
        ok = complete and value == int(task.answer)
        reason = "correct" if ok else ("broken_chain" if self._broken else "incomplete" if not complete else "wrong")
        return StepResult(None, True, float(ok), self._info(reason=reason, pred=value))

    async def close(self) -> None:
        self._task = None

    def _info(self, **extra) -> dict:
        return {"tool_calls": self._calls, "steps_done": self._done, "broken": self._broken, **extra}


def make_demonstrations(n: int, seed: int = 0, error_rate: float = 0.3, min_ops: int = 3,
                        max_ops: int = 6) -> list[list[dict]]:
    """``n`` conversations for SFT; with probability ``error_rate`` one mistake, at a uniform step of
    the chain or in the answer. A wrong call (an operand copied wrongly) gets the calculator's ``ERR``;
    the demonstration then goes on with the value it believes it got, every later call answered
    ``ERR`` too, and answers with that belief (reward 0), as the env plays it out. So a failed
    episode's states after its mistake are as many as before it on average, and all of them show it."""
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"toy_chain: error_rate must be in [0, 1], got {error_rate}")
    tasks = ToyChainTasks(n, seed, min_ops, max_ops)
    rng = random.Random(f"toy_chain/demos/{seed}")
    demos = []
    for i in range(n):
        task = tasks[i]
        steps = chain_steps(task.meta["nums"], task.meta["ops"])
        err = rng.randrange(len(steps) + 1) if rng.random() < error_rate else -1
        msgs, belief, broken = [dict(task.messages[0])], task.meta["nums"][0], False
        for k, (_, op, b, result) in enumerate(steps):
            a = belief
            if k == err:  # one operand copied wrongly: the chain breaks here
                a, b = (_perturb(rng, a), b) if rng.random() < 0.5 else (a, _perturb(rng, b))
                broken = True
            belief = apply_op(a, op, b)
            msgs += [{"role": "assistant", "content": f"<c>{a}{op}{b}</c>"},
                     {"role": "tool", "content": BROKEN if broken else str(result)}]
        final = _perturb(rng, belief) if err == len(steps) else belief
        msgs.append({"role": "assistant", "content": f"={final}"})
        demos.append(msgs)
    return demos
