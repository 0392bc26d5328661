"""What the two checked-chain environments share: the chain's steps, where an episode stands in it, and
how a demonstration makes its one mistake (envs/toy_chain.py with the toy calculator, envs/chain_python.py
with the sandboxed Python tool; they differ only in the text of a call, a tool result and an answer).

A chain is a start value and (op, operand) steps; each call must compute the next step from the previous
result. The first call that does not breaks the chain: it and every later call get the environment's
error text, so from then on the episode's return (0) is plain in the state. Reward 1 iff every step was
called correctly, in order, and the answer is the final value.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from megatron_sao.envs.toy_tool import _perturb, apply_op

Step = tuple[int, str, int, int]  # (a, op, b, a op b)


def chain_steps(start: int, ops: list[tuple[str, int]]) -> list[Step]:
    """(a, op, b, result) of every step of the correct chain."""
    out, cur = [], start
    for op, b in ops:
        nxt = apply_op(cur, op, b)
        out.append((cur, op, b, nxt))
        cur = nxt
    return out


@dataclass
class ChainProgress:
    """One episode's place in its chain: steps done in order, calls made, broken or not."""

    steps: list[Step]
    max_extra_calls: int  # calls beyond the chain's length before the episode is cut (truncated)
    done: int = 0
    calls: int = 0
    broken: bool = False

    def call_limit_reached(self) -> bool:
        return self.calls >= len(self.steps) + self.max_extra_calls

    def next_step(self) -> Step | None:
        """The step a call must compute now; None once the chain is broken or complete."""
        return None if self.broken or self.done >= len(self.steps) else self.steps[self.done]

    def record_call(self, n_calls: int, correct: bool) -> bool:
        """Count a turn's calls; a correct one advances the chain, anything else breaks it for good."""
        self.calls += n_calls
        if correct:
            self.done += 1
            return True
        self.broken = True
        return False

    def answer(self, value_matches: bool) -> tuple[float, str]:
        """(reward, reason) of the final answer; `value_matches`: it equals the chain's final value."""
        complete = self.done == len(self.steps) and not self.broken
        ok = complete and value_matches
        reason = "correct" if ok else ("broken_chain" if self.broken else "incomplete" if not complete else "wrong")
        return float(ok), reason

    def info(self, **extra) -> dict:
        return {"tool_calls": self.calls, "steps_done": self.done, "broken": self.broken, **extra}


def demonstration_calls(steps: list[Step], rng: random.Random,
                        error_rate: float) -> tuple[list[tuple[int, str, int, bool]], int]:
    """The calls of one SFT demonstration, (a, op, b, broken), and its answer. With probability
    `error_rate` one mistake at a uniform step or in the answer: an operand copied wrongly (one digit
    changed) breaks the chain; the demonstration goes on with the value it believes it got and answers
    with that belief (reward 0), as the environment plays it out. So a failed episode's states after its
    mistake are as many as before it on average, and all of them show it."""
    err = rng.randrange(len(steps) + 1) if rng.random() < error_rate else -1
    calls, belief, broken = [], steps[0][0], False
    for k, (_, op, b, _) in enumerate(steps):
        a = belief
        if k == err:
            a, b = (_perturb(rng, a), b) if rng.random() < 0.5 else (a, _perturb(rng, b))
            broken = True
        belief = apply_op(a, op, b)
        calls.append((a, op, b, broken))
    return calls, _perturb(rng, belief) if err == len(steps) else belief
