"""TrajectoryBuffer: finished trajectories wait here, oldest first, until the trainer takes a batch.

Single rollout: a trajectory enters the moment it finishes, with no grouping by prompt (GRPO, the
baseline, asks for `group_size` trajectories of one prompt and then takes whole groups).

Staleness. The lag of an action token is `current_version - version that sampled it`; a trajectory's
lag is the largest over its action tokens (pause-keep rollouts can span several versions). At
`take`, a trajectory whose lag exceeds `max_staleness` is handled by `staleness_policy`:
- "drop": removed and counted (`dropped_stale`), and its prompt is handed back through
  `on_drop` so the rollout driver runs it again *first* (a long trajectory is retried at the head
  of the queue instead of being starved behind short ones);
- "keep": trained on anyway; the DIS mask removes tokens whose ratio left the trust band.
The driver's admission control (see rollout/episodes.py) bounds how far rollouts run ahead,
so drops are rare by construction; the bound here is the guarantee.

Persistence. Every trajectory is written to `<dir>/<seq>-<traj_id>.safetensors` when it enters
(atomic write), so a crash loses nothing that finished. A consumed trajectory's file is deleted only
after a checkpoint that covers its step is committed (`release_consumed(step)`); on resume the
files still present are exactly the trajectories the checkpointed model has not trained on, and
they re-enter in their original finish order.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .trajectory import Trajectory, load_trajectories, save_trajectories


@dataclass
class BufferStats:
    received: int = 0
    failed: int = 0  # failed trajectories: recorded on disk, never trained on
    dropped_stale: int = 0
    taken: int = 0
    last_lag_histogram: dict[int, int] = field(default_factory=dict)


@dataclass
class _Entry:
    seq: int
    traj: Trajectory
    path: Path | None


class TrajectoryBuffer:
    def __init__(self, batch_size: int, max_staleness: int, staleness_policy: str = "drop",
                 directory: str | os.PathLike | None = None, group_size: int = 1,
                 on_drop: Callable[[Trajectory], None] | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if staleness_policy not in ("drop", "keep"):
            raise ValueError(f"staleness_policy must be 'drop' or 'keep', got {staleness_policy!r}")
        if batch_size % group_size:
            raise ValueError(f"batch_size {batch_size} is not a multiple of group_size {group_size}")
        self.batch_size, self.max_staleness = batch_size, max_staleness
        self.policy, self.group_size, self.on_drop = staleness_policy, group_size, on_drop
        self.dir = Path(directory) if directory is not None else None
        self.failed_dir = self.dir / "failed" if self.dir is not None else None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.failed_dir.mkdir(exist_ok=True)
        self._ready: OrderedDict[str, _Entry] = OrderedDict()  # traj_id -> entry, finish order
        self._consumed: list[tuple[int, _Entry]] = []  # (step, entry), files kept until a checkpoint
        self._seq = 0
        self._cond = threading.Condition()
        self._closed = False
        self.stats = BufferStats()

    # ------------------------------------------------------------------ producer side
    def put(self, traj: Trajectory) -> None:
        """Add a finished trajectory (thread-safe). Failed ones are recorded and counted, not trained."""
        with self._cond:
            self.stats.received += 1
            seq = self._seq
            self._seq += 1
            if not traj.trainable:
                self.stats.failed += 1
                if self.failed_dir is not None:
                    save_trajectories(self.failed_dir / f"{seq:09d}-{traj.traj_id}.safetensors", [traj])
                self._cond.notify_all()
                return
            path = None
            if self.dir is not None:
                path = self.dir / f"{seq:09d}-{traj.traj_id}.safetensors"
                save_trajectories(path, [traj])
            self._ready[traj.traj_id] = _Entry(seq, traj, path)
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._ready)

    def pending_prompt_ids(self) -> list[str]:
        with self._cond:
            return [e.traj.prompt_id for e in self._ready.values()] + [e.traj.prompt_id for _, e in self._consumed]

    # ------------------------------------------------------------------ consumer side
    def lag(self, traj: Trajectory, current_version: int) -> int:
        return current_version - traj.min_version()

    def _drop_stale(self, current_version: int) -> None:
        if self.policy != "drop":
            return
        for tid in [t for t, e in self._ready.items() if self.lag(e.traj, current_version) > self.max_staleness]:
            entry = self._ready.pop(tid)
            self.stats.dropped_stale += 1
            if entry.path is not None and entry.path.exists():
                entry.path.unlink()
            if self.on_drop is not None:
                self.on_drop(entry.traj)

    def _select(self) -> list[str] | None:
        ids = list(self._ready)
        if self.group_size == 1:
            return ids[: self.batch_size] if len(ids) >= self.batch_size else None
        groups: OrderedDict[str, list[str]] = OrderedDict()
        for tid in ids:  # groups complete in the order their last member finished
            groups.setdefault(self._ready[tid].traj.prompt_id, []).append(tid)
        complete = [g[: self.group_size] for g in groups.values() if len(g) >= self.group_size]
        if len(complete) * self.group_size < self.batch_size:
            return None
        return [tid for g in complete[: self.batch_size // self.group_size] for tid in g]

    def take(self, step: int, current_version: int, timeout: float | None = None,
             should_stop: Callable[[], bool] | None = None) -> list[Trajectory] | None:
        """Block until a batch of the oldest ready trajectories is available; None on timeout/stop."""
        with self._cond:
            while True:
                self._drop_stale(current_version)
                chosen = self._select()
                if chosen is not None:
                    break
                if self._closed or (should_stop is not None and should_stop()):
                    return None
                if not self._cond.wait(timeout=timeout if timeout is not None else 1.0) and timeout is not None:
                    return None
            batch = []
            hist: dict[int, int] = {}
            for tid in chosen:
                entry = self._ready.pop(tid)
                self._consumed.append((step, entry))
                batch.append(entry.traj)
                lag = self.lag(entry.traj, current_version)
                hist[lag] = hist.get(lag, 0) + 1
            self.stats.taken += len(batch)
            self.stats.last_lag_histogram = dict(sorted(hist.items()))
            return batch

    def release_consumed(self, up_to_step: int) -> int:
        """Delete the files of trajectories trained at steps <= up_to_step (a checkpoint covers them)."""
        with self._cond:
            keep, n = [], 0
            for step, entry in self._consumed:
                if step <= up_to_step:
                    if entry.path is not None and entry.path.exists():
                        entry.path.unlink()
                    n += 1
                else:
                    keep.append((step, entry))
            self._consumed = keep
            return n

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ------------------------------------------------------------------ resume
    def restore(self) -> list[Trajectory]:
        """Reload every trajectory file left in the directory (finish order) into the ready queue."""
        if self.dir is None:
            return []
        restored = []
        with self._cond:
            for path in sorted(self.dir.glob("*.safetensors")):
                seq = int(path.name.split("-", 1)[0])
                (traj,) = load_trajectories(path)
                self._ready[traj.traj_id] = _Entry(seq, traj, path)
                self._seq = max(self._seq, seq + 1)
                restored.append(traj)
            for path in self.failed_dir.glob("*.safetensors"):
                self._seq = max(self._seq, int(path.name.split("-", 1)[0]) + 1)
            self._cond.notify_all()
        return restored
