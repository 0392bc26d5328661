"""Toy multi-turn calculator task for tiny character-level models (the CPU demo).

A question is a chain of 1..max_ops binary operations on small non-negative integers, evaluated
left to right like a pocket calculator (no operator precedence): ``"7*8+5-3"`` = ((7*8)+5)-3.
The model cannot reliably multiply in its head, so it has to call the calculator once per
operation and copy each result into the next call. The number of operations is heavy-tailed
(p(k) proportional to k**-alpha), so the number of tool turns per trajectory has a long tail.

Compact syntax (everything is short ASCII; no system prompt, the context is ~256 chars)::

    user       "3*4+5"
    assistant  "<c>3*4</c>"      a calculator call: <c>A op B</c>, A may be negative, op in + - *
    tool       "12"              the result, or "ERR" for a malformed expression
    assistant  "<c>12+5</c>"
    tool       "17"
    assistant  "=17"             the final answer ends the episode

Reward 1 iff the final answer equals the true value *and* appeared as a calculator output in
this episode (``require_tool_result``): the answer must come from the tool, not from a lucky
guess. Any other assistant text ends the episode with reward 0; more than ``max_tool_calls``
calls ends it as truncated.
"""

from __future__ import annotations

import asyncio
import random
import re
from dataclasses import dataclass, field

from megatron_sao.envs.base import StepResult, Task, check_task_env, require_task

ENV_NAME = "toy_tool"
OPS = "+-*"
TOY_ALPHABET = "0123456789+-*=<>/cER"  # every character any toy message can contain
CALL_RE = re.compile(r"<c>(-?\d{1,6})([-+*])(\d{1,6})</c>")
ANSWER_RE = re.compile(r"=(-?\d{1,7})")
MAX_VALUE = 99_999


def op_count_pmf(max_ops: int, alpha: float) -> list[float]:
    """p(k) for k = 1..max_ops, proportional to k**-alpha (a truncated Zipf law)."""
    if max_ops < 1 or alpha <= 0:
        raise ValueError(f"need max_ops >= 1 and alpha > 0, got {max_ops}, {alpha}")
    w = [k ** -alpha for k in range(1, max_ops + 1)]
    return [x / sum(w) for x in w]


def apply_op(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def calculate(expr: str) -> str:
    """The tool: evaluate ``A op B`` (the text between <c> and </c>); "ERR" if malformed."""
    m = re.fullmatch(r"(-?\d{1,6})([-+*])(\d{1,6})", expr)
    return str(apply_op(int(m.group(1)), m.group(2), int(m.group(3)))) if m else "ERR"


def question_text(nums: list[int], ops: list[str]) -> str:
    return str(nums[0]) + "".join(o + str(b) for o, b in zip(ops, nums[1:]))


def evaluate(nums: list[int], ops: list[str]) -> int:
    cur = nums[0]
    for o, b in zip(ops, nums[1:]):
        cur = apply_op(cur, o, b)
    return cur


def _sample_chain(rng: random.Random, k: int) -> tuple[list[int], list[str]]:
    """Operands for exactly ``k`` operations with every intermediate in [0, MAX_VALUE].

    ``k`` is drawn first and kept while operands are re-drawn: rejecting whole questions would
    drop long chains more often and thin out the tail we want.
    """
    while True:
        nums, ops = [rng.randint(1, 99)], []
        cur = nums[0]
        for _ in range(k):
            op = rng.choice(OPS)
            b = rng.randint(2, 30) if op == "*" else rng.randint(1, 99)
            nxt = apply_op(cur, op, b)
            if not 0 <= nxt <= MAX_VALUE:
                break
            nums.append(b)
            ops.append(op)
            cur = nxt
        if len(ops) == k:
            return nums, ops


class ToyToolTasks:
    """``n`` seeded calculator questions (a ``TaskSource``); identical for identical arguments."""

    def __init__(self, n: int, seed: int = 0, max_ops: int = 4, alpha: float = 1.5) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.pmf = op_count_pmf(max_ops, alpha)
        rng = random.Random(seed)
        self._tasks: list[Task] = []
        for i in range(n):
            k = rng.choices(range(1, max_ops + 1), weights=self.pmf)[0]
            nums, ops = _sample_chain(rng, k)
            self._tasks.append(Task(
                prompt_id=f"toy/{seed}/{i}", env=ENV_NAME, answer=evaluate(nums, ops),
                messages=[{"role": "user", "content": question_text(nums, ops)}],
                meta={"n_ops": k, "nums": nums, "ops": ops}))

    def __len__(self) -> int:
        return len(self._tasks)

    def __getitem__(self, i: int) -> Task:
        return self._tasks[i]


def load_toy_tasks(n: int = 1000, seed: int = 0, max_ops: int = 4, alpha: float = 1.5) -> ToyToolTasks:
    return ToyToolTasks(n, seed, max_ops, alpha)


@dataclass
class ToyToolEnv:
    """The calculator environment (deterministic, in-process: no sandbox, microseconds per step)."""

    max_tool_calls: int = 8
    require_tool_result: bool = True
    # Simulated tool latency for throughput benchmarks: each call waits tool_latency_s * X seconds,
    # X ~ Pareto(latency_tail) capped at 100 (heavy-tailed, like real tools and sandboxes). 0 = off.
    tool_latency_s: float = 0.0
    latency_tail: float = 1.5
    name: str = ENV_NAME
    _outputs: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self._task: Task | None = None

    async def reset(self, task: Task) -> None:
        check_task_env(self.name, task)
        self._task, self._outputs = task, []

    async def step(self, action_text: str) -> StepResult:
        task = require_task(self.name, self._task)
        text = action_text.strip()
        if text.startswith("<c>"):
            if len(self._outputs) >= self.max_tool_calls:
                return StepResult(None, True, 0.0, self._info(reason="tool_call_limit", truncated=True))
            if self.tool_latency_s > 0:
                await asyncio.sleep(self.tool_latency_s * min(random.paretovariate(self.latency_tail), 100.0))
            inner = text[3:-4] if text.endswith("</c>") else text[3:]
            result = calculate(inner)
            self._outputs.append(result)
            return StepResult(result, False, 0.0, self._info())
        m = ANSWER_RE.fullmatch(text)
        if m is None:
            return StepResult(None, True, 0.0, self._info(reason="no_tool_call_or_answer"))
        value = int(m.group(1))
        correct = value == int(task.answer)
        used_tool = str(value) in self._outputs
        ok = correct and (used_tool or not self.require_tool_result)
        reason = "correct" if ok else ("answer_not_from_tool" if correct else "wrong")
        return StepResult(None, True, float(ok), self._info(reason=reason, pred=value))

    async def close(self) -> None:
        self._task = None

    def _info(self, **extra) -> dict:
        return {"tool_calls": len(self._outputs), **extra}


def reference_actions(task: Task) -> list[str]:
    """The actions of a correct episode: one calculator call per operation, then the answer."""
    calls = _calls(task.meta["nums"], task.meta["ops"], -1, 0, 0)
    return [f"<c>{a}{op}{b}</c>" for a, op, b, _ in calls] + [f"={calls[-1][3]}"]


def _perturb(rng: random.Random, value: int) -> int:
    """Change one digit of ``value`` (never to a leading zero), giving a different number."""
    s = str(abs(value))
    i = rng.randrange(len(s))
    choices = [d for d in "0123456789" if d != s[i] and not (i == 0 and d == "0" and len(s) > 1)]
    t = s[:i] + rng.choice(choices) + s[i + 1:]
    return -int(t) if value < 0 else int(t)


def make_demonstrations(n: int, seed: int = 0, error_rate: float = 0.3, max_ops: int = 4,
                        alpha: float = 1.5) -> list[list[dict]]:
    """``n`` complete conversations (user / assistant / tool messages) for SFT.

    With probability ``error_rate`` one step is wrong: a calculator call with a wrong operand
    (a mistyped number, or the previous result copied wrongly) or a wrongly copied final answer.
    The tool messages always show what the calculator really returns for the call made, so the
    conversation stays consistent and the final answer of a flawed demonstration is wrong.
    """
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
    tasks = ToyToolTasks(n, seed, max_ops, alpha)
    rng = random.Random(seed + 1_000_003)  # independent of the question stream
    demos = []
    for task in tasks:
        nums, ops = task.meta["nums"], task.meta["ops"]
        k = len(ops)
        err_step = rng.randrange(k + 1) if rng.random() < error_rate else -1
        calls = _flawed_calls(rng, nums, ops, err_step) if 0 <= err_step < k else None
        if calls is None:  # no error, an error in the final copy, or no in-range flawed chain
            calls = _calls(nums, ops, -1, 0, 0)
            err_step = k if err_step >= 0 else -1
        msgs = [dict(task.messages[0])]
        for a, op, b, result in calls:
            msgs.append({"role": "assistant", "content": f"<c>{a}{op}{b}</c>"})
            msgs.append({"role": "tool", "content": str(result)})
        final = calls[-1][3]
        msgs.append({"role": "assistant", "content": f"={_perturb(rng, final) if err_step == k else final}"})
        demos.append(msgs)
    return demos


def _calls(nums: list[int], ops: list[str], err_step: int, new_a: int, new_b: int) -> list[tuple]:
    """The (a, op, b, result) calls of a chain, with step ``err_step`` using operands new_a, new_b."""
    out, cur = [], nums[0]
    for j, op in enumerate(ops):
        a, b = (new_a, new_b) if j == err_step else (cur, nums[j + 1])
        cur = apply_op(a, op, b)
        out.append((a, op, b, cur))
    return out


def _flawed_calls(rng: random.Random, nums: list[int], ops: list[str], err_step: int) -> list[tuple] | None:
    """A chain with one wrong operand at ``err_step`` whose values all fit the calculator (6 digits).

    A mistyped digit can push later products past what ``calculate`` accepts, which would make
    the demonstration disagree with the real tool; such draws are re-drawn.
    """
    correct = _calls(nums, ops, -1, 0, 0)
    a0 = nums[0] if err_step == 0 else correct[err_step - 1][3]
    b0 = nums[err_step + 1]
    for _ in range(50):
        a, b = (a0, _perturb(rng, b0)) if rng.random() < 0.5 else (_perturb(rng, a0), b0)
        calls = _calls(nums, ops, err_step, a, b)
        if all(abs(c[3]) <= 999_999 for c in calls):
            return calls
    return None
