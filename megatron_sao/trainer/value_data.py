"""The data of value pretraining: a held-out split by prompt, and batches that visit every training
trajectory once per epoch.

Held out by prompt, not by row: two trajectories of one prompt share everything up to their first
sampled token, so a critic trained on one of them has seen most of the other's states. The split is
a function of the prompt ids and a seed alone (sha256, not Python's salted `hash`), the same on every
rank and in every process.
"""

from __future__ import annotations

import hashlib
import math
import random
from typing import Sequence, TypeVar

T = TypeVar("T")


def _rank(prompt_id: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{prompt_id}".encode()).hexdigest()


def split_heldout(trajs: Sequence[T], fraction: float, seed: int) -> tuple[list[T], list[T]]:
    """(train, heldout): the trajectories of round(fraction * prompts) prompts, chosen by a seeded hash
    of the prompt id, are held out; at least one prompt on each side. Order within each side is kept."""
    if not 0 < fraction < 1:
        raise ValueError(f"split_heldout: fraction must be in (0, 1), got {fraction}")
    prompts = sorted({t.prompt_id for t in trajs}, key=lambda p: _rank(p, seed))
    if len(prompts) < 2:
        raise ValueError(f"split_heldout: needs trajectories of at least 2 prompts, got {len(prompts)}")
    n_held = min(max(1, round(fraction * len(prompts))), len(prompts) - 1)
    held = set(prompts[:n_held])
    return [t for t in trajs if t.prompt_id not in held], [t for t in trajs if t.prompt_id in held]


class EpochBatches:
    """Batches of `batch_size` items drawn without replacement, reshuffled every epoch: every training
    trajectory is seen once per epoch (drawing with replacement leaves a third of them out of any
    given epoch's worth of steps). A batch that crosses an epoch's end takes the rest of the old
    epoch and the start of the new one."""

    def __init__(self, items: Sequence[T], batch_size: int, seed: int) -> None:
        if not items:
            raise ValueError("EpochBatches: no items")
        if batch_size < 1:
            raise ValueError(f"EpochBatches: batch_size must be >= 1, got {batch_size}")
        self.items, self.batch_size = list(items), min(batch_size, len(items))
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.epoch = -1

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.items) / self.batch_size)

    def next(self) -> list[T]:
        take: list[int] = []
        while len(take) < self.batch_size:
            if not self.order:  # a new epoch; what this batch already holds goes last, so no row repeats in it
                order = list(range(len(self.items)))
                self.rng.shuffle(order)
                self.order = [i for i in order if i not in take] + [i for i in order if i in take]
                self.epoch += 1
            n = self.batch_size - len(take)
            take, self.order = take + self.order[:n], self.order[n:]
        return [self.items[i] for i in take]
