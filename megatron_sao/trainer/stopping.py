"""Why a training run stops before its last step: the two outcomes, and the non-finite step policy."""

from __future__ import annotations

import logging
from typing import Callable

logger = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (non-finite steps, dead rollout engine); a checkpoint was written."""


class TrainingInterrupted(RuntimeError):
    """Ctrl-C / SIGTERM: the current step finished, a checkpoint was written, the run ended."""


class NonFiniteGuard:
    """A step whose loss or gradient is NaN/inf is skipped by the optimizer and logged; ``limit`` of
    them in a row for one model stop the run, after ``save()``, before any further step
    (``sao_step`` calls it after every optimizer step)."""

    def __init__(self, limit: int, save: Callable[[], None]) -> None:
        self.limit, self.save = limit, save
        self.in_a_row = {"actor": 0, "critic": 0}  # checkpointed (trainer state "nonfinite")

    def check(self, res, role: str, step: int) -> None:
        if not res.skipped:
            self.in_a_row[role] = 0
            return
        n = self.in_a_row[role] = self.in_a_row[role] + 1
        logger.warning("%s step %d: non-finite loss/grad, update skipped (%d in a row)", role, step, n)
        if n >= self.limit:
            self.save()
            raise TrainingStopped(f"{n} non-finite {role} steps in a row at step {step}; checkpoint written")
