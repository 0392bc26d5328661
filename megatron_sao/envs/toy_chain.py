"""Calculator chains for the toy model: 3-6 dependent calls, a broken chain visible in the next tool result.

A task whose return a critic can read from the state. The question is a chain of `min_ops..max_ops`
operations evaluated left to right (toy_tool's format, ``"14*3+5-2"``); the model calls the
calculator once per step, each call starting from the previous result::

    user       "14*3+5-2"
    assistant  "<c>14*3</c>"    tool "42"
    assistant  "<c>42+5</c>"    tool "47"
    assistant  "<c>47-2</c>"    tool "45"
    assistant  "=45"            reward 1

The calculator holds the chain (envs/chain_progress.py, shared with envs/chain_python.py): a call
that is not the chain's next step (the previous result or the operand copied wrongly, a wrong
operator, a malformed call, a call past the last step) answers ``ERR`` and breaks the chain, and
every later call answers ``ERR`` too. So a mistake shows in the tool result that follows it, and
from then on the episode's return (0) is plain in the state. Reward 1 iff every step was called
correctly and the answer is the chain's final value.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from megatron_sao.envs.base import StepResult, Task, check_task_env, require_task
from megatron_sao.envs.chain_progress import ChainProgress, Step, chain_steps, demonstration_calls
from megatron_sao.envs.toy_tool import ANSWER_RE, _sample_chain, evaluate, question_text

ENV_NAME = "toy_chain"
BROKEN = "ERR"


def _steps(task: Task) -> list[Step]:
    nums, ops = task.meta["nums"], task.meta["ops"]
    return chain_steps(nums[0], list(zip(ops, nums[1:])))


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
    steps = _steps(task)
    return [f"<c>{a}{op}{b}</c>" for a, op, b, _ in steps] + [f"={steps[-1][3]}"]


@dataclass
class ToyChainEnv:
    """The checked calculator chain (deterministic, in-process)."""

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
        text = action_text.strip()
        if text.startswith("<c>"):
            if progress.call_limit_reached():
                return StepResult(None, True, 0.0, progress.info(reason="tool_call_limit", truncated=True))
            inner = text[3:-4] if text.endswith("</c>") else text[3:]
            expected = progress.next_step()
            if progress.record_call(1, expected is not None and inner == f"{expected[0]}{expected[1]}{expected[2]}"):
                return StepResult(str(expected[3]), False, 0.0, progress.info())
            return StepResult(BROKEN, False, 0.0, progress.info())
        m = ANSWER_RE.fullmatch(text)
        if m is None:
            return StepResult(None, True, 0.0, progress.info(reason="no_tool_call_or_answer"))
        value = int(m.group(1))
        reward, reason = progress.answer(value == int(task.answer))
        return StepResult(None, True, reward, progress.info(reason=reason, pred=value))

    async def close(self) -> None:
        self._task = self._progress = None


def make_demonstrations(n: int, seed: int = 0, error_rate: float = 0.3, min_ops: int = 3,
                        max_ops: int = 6) -> list[list[dict]]:
    """``n`` conversations for SFT, a fraction ``error_rate`` of them with one mistake
    (chain_progress.demonstration_calls); a call after the mistake gets the calculator's ``ERR``."""
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"toy_chain: error_rate must be in [0, 1], got {error_rate}")
    tasks = ToyChainTasks(n, seed, min_ops, max_ops)
    rng = random.Random(f"toy_chain/demos/{seed}")
    demos = []
    for i in range(n):
        task = tasks[i]
        steps = _steps(task)
        calls, final = demonstration_calls(steps, rng, error_rate)
        msgs = [dict(task.messages[0])]
        for (a, op, b, broken), (*_, result) in zip(calls, steps):
            msgs += [{"role": "assistant", "content": f"<c>{a}{op}{b}</c>"},
                     {"role": "tool", "content": BROKEN if broken else str(result)}]
        msgs.append({"role": "assistant", "content": f"={final}"})
        demos.append(msgs)
    return demos
