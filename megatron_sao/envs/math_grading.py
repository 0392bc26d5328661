"""Math answer checking with math-verify, safe to call from the rollout driver's threads.

math-verify bounds its own time with SIGALRM, which only works in the main thread, and the
rollout driver is an asyncio loop in a background thread. So we call it with its timeouts
disabled (``parsing_timeout=None``, ``timeout_seconds=None`` in math-verify 0.9) on a small
dedicated thread pool and bound the wait with ``asyncio.wait_for``. A grading call that runs
past the bound is scored 0 and reported; its thread cannot be interrupted and finishes in the
background (inputs are clipped to ``MAX_ANSWER_CHARS`` so that stays rare and short).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from math_verify import parse, verify

MAX_ANSWER_CHARS = 1000
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="math-grade")


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns on every call made with timeouts disabled; we disable them on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


@dataclass
class GradeResult:
    correct: bool
    reason: str  # "correct" | "wrong" | "no_answer" | "grading_timeout" | "grading_error"


def grade_boxed(gold: str, boxed: str | None) -> GradeResult:
    """Compare the content of a ``\\boxed{}`` with the gold answer (gold first, as math-verify wants)."""
    if boxed is None or not boxed.strip():
        return GradeResult(False, "no_answer")
    if len(boxed) > MAX_ANSWER_CHARS:
        return GradeResult(False, "wrong")
    try:
        gold_parsed = parse(_as_latex(str(gold)), parsing_timeout=None)
        pred_parsed = parse("\\boxed{" + boxed + "}", parsing_timeout=None)
        ok = bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))
    except Exception as e:  # math-verify/sympy can raise on odd input; that is a wrong answer
        return GradeResult(False, f"grading_error: {type(e).__name__}")
    return GradeResult(ok, "correct" if ok else "wrong")


def _as_latex(gold: str) -> str:
    """Gold answers in the datasets are bare (``70``, ``\\frac{1}{2}``); box them for the parser."""
    return gold if "\\boxed" in gold else "\\boxed{" + gold + "}"


async def grade_boxed_async(gold: str, boxed: str | None, timeout_s: float = 10.0) -> GradeResult:
    """``grade_boxed`` off the event loop, bounded by ``timeout_s``."""
    loop = asyncio.get_running_loop()
    try:
        return await asyncio.wait_for(loop.run_in_executor(_POOL, grade_boxed, gold, boxed), timeout_s)
    except asyncio.TimeoutError:
        return GradeResult(False, "grading_timeout")
