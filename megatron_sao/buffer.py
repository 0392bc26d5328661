"""TrajectoryBuffer: finished trajectories wait here, oldest first, until the trainer takes a batch.

Single rollout: a trajectory enters the moment it finishes, with no grouping by prompt (GRPO, the
baseline, asks for `group_size` trajectories of one prompt and then takes whole groups). A group is
complete when all `group_size` members have finished: a failed member (recorded, never trained on)
counts as finished, so the group trains on its other members (`groups_with_failures` counts them)
instead of waiting forever for a member that will not come.

Episodes. A batch is `batch_size` episodes: an agent-loop episode is one trajectory, a harness episode
(rollout/agent_endpoint/) one trajectory per segment of its history, all sharing `info["episode"]` and
handed over in order, its end last. An episode is taken, dropped as stale (by its stalest segment) and
requeued whole, so the admission control's unit (an episode) is the batch's unit too: with segments a
batch has more rows than `batch_size`, and a synchronous run still trains every batch at lag 0.

Staleness. The lag of an action token is `current_version - version that sampled it`; a trajectory's
lag is the largest over its action tokens (pause-keep rollouts can span several versions). At
`take`, a trajectory whose lag exceeds `max_staleness` is handled by `staleness_policy`:
- "keep" (default): trained on anyway; the DIS mask removes tokens whose ratio left the trust band.
  The paper sends every finished trajectory to training; admission control (rollout/episode_driver.py)
  still bounds how far rollouts start ahead, so only episodes longer than that bound arrive stale.
- "drop": removed and counted (`dropped_stale`), and its prompt is handed back through
  `on_drop` so the rollout driver runs it again *first*. An episode longer than the bound is stale
  on every try, so one prompt (prompt id + sample) is dropped at most `max_stale_drops` times; its
  next trajectory is trained on however stale (`kept_after_drops`). The counts live in memory: a
  resumed run starts them again.

Persistence. Every trajectory is written to `<dir>/<seq>-<traj_id>.safetensors` when it enters
(atomic write), so a crash loses nothing that finished. A consumed trajectory's file is kept until
the *older* of the two kept checkpoints covers its step (`release_consumed`, called by the trainer
after a commit), so a fallback to that checkpoint still finds it. Each checkpoint records which
consumed files it covers (`covered()`); resume (`restore(covered)`) treats those as consumed
whatever state they are in, and only the other files re-enter, in their original finish order.
A kill between the commit and the release therefore never trains a trajectory twice. A file in the
directory that is not one of the buffer's (another name, or one that does not load) is moved to
`<dir>/set_aside/` with a warning naming it, and resume goes on without it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from megatron_sao.faults import fault_point
from megatron_sao.trajectory import Trajectory, TrajectoryFileError, load_trajectories, save_trajectories

logger = logging.getLogger(__name__)
STOP_POLL_S = 0.5  # take(): how often should_stop is asked while no trajectory arrives


@dataclass
class BufferStats:
    received: int = 0
    failed: int = 0  # failed trajectories: recorded on disk, never trained on
    dropped_stale: int = 0
    kept_after_drops: int = 0  # stale trajectories trained on because their prompt hit max_stale_drops
    groups_with_failures: int = 0  # groups trained without their failed members
    taken: int = 0
    last_lag_histogram: dict[int, int] = field(default_factory=dict)


@dataclass
class _Entry:
    seq: int
    traj: Trajectory | None  # None: a consumed file restored on resume (never read again)
    path: Path | None
    traj_id: str = ""


class TrajectoryBuffer:
    def __init__(self, batch_size: int, max_staleness: int, staleness_policy: str = "keep",
                 directory: str | os.PathLike | None = None, group_size: int = 1,
                 on_drop: Callable[[Trajectory], None] | None = None, max_stale_drops: int = 2):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if staleness_policy not in ("drop", "keep"):
            raise ValueError(f"staleness_policy must be 'drop' or 'keep', got {staleness_policy!r}")
        if batch_size % group_size:
            raise ValueError(f"batch_size {batch_size} is not a multiple of group_size {group_size}")
        if max_stale_drops < 0:
            raise ValueError(f"max_stale_drops must be >= 0, got {max_stale_drops}")
        self.batch_size, self.max_staleness = batch_size, max_staleness
        self.policy, self.group_size, self.on_drop = staleness_policy, group_size, on_drop
        self.max_stale_drops = max_stale_drops
        self._drops: dict[str, int] = {}  # prompt id + sample -> times dropped as stale
        self._failed_members: dict[str, int] = {}  # grouped: prompt id -> failed members so far
        self.dir = Path(directory) if directory is not None else None
        self.failed_dir = self.dir / "failed" if self.dir is not None else None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.failed_dir.mkdir(exist_ok=True)
            for d in (self.dir, self.failed_dir):  # half-written by a process that died mid-write
                for tmp in d.glob("*.tmp-*"):
                    tmp.unlink(missing_ok=True)
        self._ready: OrderedDict[str, _Entry] = OrderedDict()  # traj_id -> entry, finish order
        self._consumed: list[tuple[int, _Entry]] = []  # (step, entry), files kept until a checkpoint
        self._seq = 0
        self._restored: list[Trajectory] | None = None
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
                self._count_failed_member(traj)
                self._cond.notify_all()
                return
            path = None
            if self.dir is not None:
                path = self.dir / f"{seq:09d}-{traj.traj_id}.safetensors"
                save_trajectories(path, [traj])
                fault_point("buffer_put")
            self._ready[traj.traj_id] = _Entry(seq, traj, path, traj.traj_id)
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._ready)

    # ------------------------------------------------------------------ consumer side
    def lag(self, traj: Trajectory, current_version: int) -> int:
        return current_version - traj.min_version()

    @staticmethod
    def _unit_key(traj: Trajectory) -> str:
        return f"{traj.prompt_id}#{traj.info.get('sample', 0)}"

    def _count_failed_member(self, traj: Trajectory) -> None:
        if self.group_size == 1:
            return
        n = self._failed_members.get(traj.prompt_id, 0) + 1
        if n >= self.group_size:  # every member failed: nothing of this group will ever be trained
            self._failed_members.pop(traj.prompt_id, None)
        else:
            self._failed_members[traj.prompt_id] = n

    def _episodes(self) -> list[list[str]]:
        """The ready trajectories by episode, in the order episodes began arriving; only whole episodes
        (their last trajectory is here: a harness episode's segments arrive in order, its end last)."""
        groups: OrderedDict[str, list[str]] = OrderedDict()
        ended = set()
        for tid, e in self._ready.items():
            groups.setdefault(e.traj.episode, []).append(tid)
            if e.traj.ends_episode:
                ended.add(e.traj.episode)
        return [g for ep, g in groups.items() if ep in ended]

    def _drop_stale(self, current_version: int) -> None:
        if self.policy != "drop":
            return
        for tids in self._episodes():  # an episode is dropped whole, as it is trained whole
            if max(self.lag(self._ready[t].traj, current_version) for t in tids) <= self.max_staleness:
                continue
            end = self._ready[tids[-1]].traj
            key = self._unit_key(end)
            if self._drops.get(key, 0) >= self.max_stale_drops:
                continue  # dropped often enough: trained on at this arrival (see the module docstring)
            self._drops[key] = self._drops.get(key, 0) + 1
            for tid in tids:
                entry = self._ready.pop(tid)
                self.stats.dropped_stale += 1
                if entry.path is not None and entry.path.exists():
                    entry.path.unlink()
            if self.on_drop is not None:
                self.on_drop(end)

    def _select(self) -> list[str] | None:
        if self.group_size == 1:  # batch_size episodes, each with all its trajectories
            episodes = self._episodes()
            if len(episodes) < self.batch_size:
                return None
            return [tid for g in episodes[: self.batch_size] for tid in g]
        ids = list(self._ready)
        groups: OrderedDict[str, list[str]] = OrderedDict()
        for tid in ids:  # groups in the order their first member finished; a group is taken once complete
            groups.setdefault(self._ready[tid].traj.prompt_id, []).append(tid)
        # A failed member has finished too: its group is complete without it.
        complete = [g[: self.group_size - self._failed_members.get(pid, 0)] for pid, g in groups.items()
                    if len(g) + self._failed_members.get(pid, 0) >= self.group_size]
        if len(complete) < self.batch_size // self.group_size:
            return None
        return [tid for g in complete[: self.batch_size // self.group_size] for tid in g]

    def take(self, step: int, current_version: int, timeout: float | None = None,
             should_stop: Callable[[], bool] | None = None) -> list[Trajectory] | None:
        """Block until a batch of the oldest ready trajectories is available. None once ``timeout``
        seconds pass with no trajectory arriving (a liveness bound, not a batch deadline: a batch of long
        trajectories that keep arriving waits as long as it needs), or once ``should_stop()`` is true
        (asked at least every STOP_POLL_S: a stop request or a server to readmit wakes no wait)."""
        with self._cond:
            received, quiet_since = self.stats.received, time.monotonic()
            while True:
                self._drop_stale(current_version)
                chosen = self._select()
                if chosen is not None:
                    break
                if self._closed or (should_stop is not None and should_stop()):
                    return None
                if self.stats.received != received:
                    received, quiet_since = self.stats.received, time.monotonic()
                left = None if timeout is None else quiet_since + timeout - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(timeout=STOP_POLL_S if left is None else min(left, STOP_POLL_S))
            batch = []
            hist: dict[int, int] = {}
            for tid in chosen:
                entry = self._ready.pop(tid)
                self._consumed.append((step, entry))
                batch.append(entry.traj)
                lag = self.lag(entry.traj, current_version)
                hist[lag] = hist.get(lag, 0) + 1
                if self._drops.pop(self._unit_key(entry.traj), 0) and lag > self.max_staleness:
                    self.stats.kept_after_drops += 1
            for pid in dict.fromkeys(t.prompt_id for t in batch):
                if self._failed_members.pop(pid, 0):
                    self.stats.groups_with_failures += 1
            self.stats.taken += len(batch)
            self.stats.last_lag_histogram = dict(sorted(hist.items()))
            fault_point("batch_taken")
            return batch

    def covered(self) -> list[list]:
        """[traj_id, step] of every consumed trajectory whose file is still kept: what a checkpoint
        written now covers (trainer_state.json records it for `restore`)."""
        with self._cond:
            return [[e.traj_id, step] for step, e in self._consumed]

    def release_consumed(self, up_to_step: int) -> int:
        """Delete the files of trajectories trained at steps <= up_to_step (the checkpoints that
        could be resumed from all cover them)."""
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
    def restore(self, covered: dict[str, int] | None = None,
                unusable: Callable[[Trajectory], str | None] | None = None) -> list[Trajectory]:
        """Resume: reload the trajectory files left in the directory into the ready queue (finish
        order), except those the checkpoint covers (`covered`: traj_id -> step that trained it),
        which are consumed whatever state their files are in and are only kept for release, and
        those `unusable` gives a reason for (the trainer's: routes of another model), set aside.
        Idempotent: later calls return the first call's list."""
        if self.dir is None:
            return []
        covered = covered or {}
        with self._cond:
            if self._restored is not None:
                return list(self._restored)
            restored = []
            for path in sorted(self.dir.glob("*.safetensors")):
                seq, traj_id = _seq_and_id(path)
                if seq is None:
                    continue
                self._seq = max(self._seq, seq + 1)
                if traj_id in covered:
                    self._consumed.append((covered[traj_id], _Entry(seq, None, path, traj_id)))
                    continue
                traj = _load_one(path)
                why = unusable(traj) if traj is not None and unusable is not None else None
                if why is not None:
                    _set_aside(path, f"cannot be trained on ({why})")
                    traj = None
                if traj is not None:
                    self._ready[traj.traj_id] = _Entry(seq, traj, path, traj.traj_id)
                    restored.append(traj)
            for path in sorted(self.failed_dir.glob("*.safetensors")):
                seq, _ = _seq_and_id(path)
                if seq is None:
                    continue
                self._seq = max(self._seq, seq + 1)
                if self.group_size > 1 and (traj := _load_one(path)) is not None:
                    self._count_failed_member(traj)  # a group waiting for members must know its failed ones
            self._restored = restored
            self._cond.notify_all()
        return list(restored)


    def set_aside(self, traj_ids: list[str], why: str) -> None:
        """Take restored trajectories out of the ready queue and move their files aside (never deleted)."""
        with self._cond:
            for tid in traj_ids:
                entry = self._ready.pop(tid, None)
                if entry is not None and entry.path is not None:
                    _set_aside(entry.path, why)
                if self._restored is not None:
                    self._restored = [t for t in self._restored if t.traj_id != tid]


# ---------------------------------------------------------------------- files that are not the buffer's
SET_ASIDE = "set_aside"  # <dir>/set_aside/: files found in the buffer that resume cannot use


def _set_aside(path: Path, why: str) -> None:
    """Move a file resume cannot use out of the way (never deleted: it may be someone's), naming it."""
    dest_dir = path.parent / SET_ASIDE
    dest_dir.mkdir(exist_ok=True)
    dest = dest_dir / path.name
    path.replace(dest)
    logger.warning("buffer: %s %s; set aside as %s", path, why, dest)


def _seq_and_id(path: Path) -> tuple[int | None, str]:
    """`<seq>-<traj_id>.safetensors` -> (seq, traj_id); anything else is set aside: (None, "")."""
    seq_text, _, rest = path.name.partition("-")
    if not (seq_text.isdigit() and rest.endswith(".safetensors") and len(rest) > len(".safetensors")):
        _set_aside(path, "is not a trajectory file of this buffer (expected <seq>-<traj_id>.safetensors)")
        return None, ""
    return int(seq_text), rest[: -len(".safetensors")]


def _load_one(path: Path) -> Trajectory | None:
    try:
        (traj,) = load_trajectories(path)
    except (TrajectoryFileError, ValueError) as e:
        _set_aside(path, f"cannot be read ({e})")
        return None
    return traj
