"""The non-finite step policy: how many skipped optimizer steps in a row stop a run."""

from __future__ import annotations

import logging
from typing import Callable

from megatron_sao.errors import TrainingStopped

logger = logging.getLogger(__name__)


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
