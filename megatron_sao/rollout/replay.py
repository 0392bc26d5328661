"""Stands in for the rollout side when ``trainer.replay`` names a trajectory file."""

from __future__ import annotations

from typing import Any, Callable

from megatron_sao.trajectory import Trajectory, load_trajectories


class ReplaySource:
    """The file's trajectories enter the buffer in file order; there is no rollout engine to sync."""

    def __init__(self, path, put: Callable[[Trajectory], None], fresh: bool):
        trajs = load_trajectories(path)
        if fresh:  # on resume the buffer directory already holds what is left
            for t in trajs:
                put(t)
        self.error = None
        self.finished, self.failed, self.in_flight = len(trajs), 0, set()

    def step_finished(self) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {"next_pos": 0, "in_flight": [], "queued": []}

    def engine_idle_fraction(self) -> float:
        return 0.0

    def metrics(self) -> dict:
        return {}

    def close(self) -> None:
        pass
