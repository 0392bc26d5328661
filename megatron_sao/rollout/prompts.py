"""The training prompt stream and the unit of rollout work.

A unit is one episode of one prompt: ``(pos, k)`` = position ``pos`` in the prompt stream and sample
``k`` (always 0 for SAO's single rollout; GRPO runs k = 0..group_size-1 of the same prompt).
"""

from __future__ import annotations

import random

from megatron_sao.envs.base import Task
from megatron_sao.trajectory import Trajectory

Unit = tuple[int, int]  # (position in the prompt stream, sample index)


def unit_of(traj: Trajectory) -> Unit:
    return int(traj.info["data_pos"]), int(traj.info.get("sample", 0))


def complete_units(trajs: list[Trajectory]) -> tuple[set[Unit], list[str]]:
    """Resume: the units whose episode is whole in ``trajs`` (their trajectory, or all their segments: the
    driver hands an episode's segments over in order, its end last), and the ids of segments whose episode
    has no end here (the run stopped between two of its files): those are set aside and the unit re-runs."""
    ended = {unit_of(t) for t in trajs if t.ends_episode}
    partial = [t.traj_id for t in trajs if unit_of(t) not in ended]
    return ended, partial


class PromptStream:
    """An endless, seeded stream of tasks: epoch e visits a permutation of the dataset."""

    def __init__(self, tasks, seed: int):
        if len(tasks) == 0:
            raise ValueError("the training task source is empty")
        self.tasks, self.seed = tasks, seed
        self._perms: dict[int, list[int]] = {}

    def __getitem__(self, pos: int) -> Task:
        n = len(self.tasks)
        epoch, i = divmod(pos, n)
        if epoch not in self._perms:
            perm = list(range(n))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(perm)
            self._perms = {epoch: perm}  # keep only the current epoch
        return self.tasks[self._perms[epoch][i]]
