"""The rollout driver: keeps single-rollout episodes in flight on rank 0 and feeds the buffer.

It runs an asyncio loop in a background thread (DESIGN.md, Processes). Each unit of work is one
episode of one prompt: `(pos, k)` = position `pos` in the prompt stream and sample `k` (k is always
0 for SAO's single rollout; GRPO runs k = 0..group_size-1 of the same prompt).

Admission control (after AReaL's bound on how far rollouts run ahead of training): an episode may
start only while `started_units < (steps_done + ahead + 1) * batch_size`, where `steps_done` counts
batches the trainer has finished (including weight sync). `ahead = 0` is the synchronous mode
(one batch, then a barrier); the asynchronous mode uses `ahead = max_staleness`, so no trajectory is
started more than `max_staleness` steps before it is trained on, and the buffer's staleness check
rarely has anything to drop. Units handed back by the buffer (dropped as stale) go to the *front* of
the queue: a long trajectory that went stale is retried next, not starved.

Data position for resume: `next_pos` plus the units in flight; the trainer checkpoints both, and on
resume re-runs in-flight units whose trajectory did not reach the buffer's directory.

Each episode's task carries `meta["policy_step"]`: the trainer steps finished when it started
(`step_offset + steps_done`; `step_offset` is the step a resumed run starts from). Non-stationary
environments read it (the style-shift task picks its preferred style by it), so the reward follows
the trainer's progress, not wall time or how far the rollouts ran ahead. It is recorded in
`traj.info["policy_step"]` as well.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from typing import Any, Callable

from megatron_sao.envs.base import Task
from megatron_sao.rollout.agent_loop import AgentLoopConfig, EngineActivity, run_one
from megatron_sao.trajectory import Trajectory

Unit = tuple[int, int]  # (position in the prompt stream, sample index)


def unit_of(traj: Trajectory) -> Unit:
    return int(traj.info["data_pos"]), int(traj.info.get("sample", 0))


class PromptStream:
    """An endless, seeded stream of tasks: epoch e visits a permutation of the dataset."""

    def __init__(self, tasks, seed: int):
        if len(tasks) == 0:
            raise ValueError("the training task source is empty")
        self.tasks, self.seed = tasks, seed
        self._perms: dict[int, list[int]] = {}

    def __getitem__(self, pos: int) -> Task:
        import random

        n = len(self.tasks)
        epoch, i = divmod(pos, n)
        if epoch not in self._perms:
            perm = list(range(n))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(perm)
            self._perms = {epoch: perm}  # keep only the current epoch
        return self.tasks[self._perms[epoch][i]]


class RolloutDriver:
    def __init__(self, engine, env_factory: Callable[[Task], Any], stream: PromptStream, formatter,
                 loop_cfg: AgentLoopConfig, on_done: Callable[[Trajectory], None], *, batch_size: int,
                 ahead: int, concurrency: int, group_size: int = 1, next_pos: int = 0,
                 requeue: list[Unit] | None = None, skip: set[Unit] | None = None, step_offset: int = 0):
        self.engine, self.env_factory, self.stream, self.formatter = engine, env_factory, stream, formatter
        self.loop_cfg, self.on_done = loop_cfg, on_done
        self.batch_size, self.ahead, self.concurrency, self.group_size = batch_size, ahead, concurrency, group_size
        self.next_pos = next_pos
        self._queue: collections.deque[Unit] = collections.deque(requeue or [])
        self._skip = set(skip or ())  # units whose trajectory is already in the buffer (resume)
        self.in_flight: set[Unit] = set()
        self.started = 0  # units started since this driver was created (admission counter)
        self.steps_done = 0  # steps finished since this driver was created (admission is relative to it)
        self.step_offset = step_offset  # trainer steps finished before it (resume), for policy_step
        self.finished = 0
        self.failed = 0
        self.activity = EngineActivity()
        self.failed_in_a_row = 0
        self.failure_threshold = max(8, concurrency)
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._t_start = time.monotonic()

    # ------------------------------------------------------------------ thread-safe controls
    def start(self) -> None:
        ready = threading.Event()

        def run():
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            self._stop, self._wake = asyncio.Event(), asyncio.Event()
            ready.set()
            try:
                self.loop.run_until_complete(self._main())
            except BaseException as e:  # noqa: BLE001 - reported to the trainer through .error
                self.error = e
            finally:
                self.loop.close()

        self._thread = threading.Thread(target=run, name="rollout-driver", daemon=True)
        self._thread.start()
        ready.wait()

    def call(self, coro, timeout: float | None = None):
        """Run a coroutine on the driver's loop from the trainer thread and wait for its result."""
        if self.loop is None or not self._thread.is_alive():
            raise RuntimeError(f"the rollout driver is not running (error: {self.error!r})")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def step_finished(self) -> None:
        with self._lock:
            self.steps_done += 1
        self._poke()

    def requeue(self, traj: Trajectory) -> None:
        with self._lock:
            self._queue.appendleft(unit_of(traj))
            self.started -= 1  # it will be started again and must not use up the admission budget
        self._poke()

    def stop(self, timeout: float = 30.0) -> None:
        if self.loop is not None and self._thread is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout)

    def _poke(self) -> None:
        if self.loop is not None and self._wake is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._wake.set)

    def state(self) -> dict[str, Any]:
        with self._lock:
            return {"next_pos": self.next_pos, "in_flight": sorted(self.in_flight), "queued": list(self._queue)}

    def engine_idle_fraction(self) -> float:
        total = time.monotonic() - self._t_start
        return self.activity.total_idle_s() / total if total > 0 else 0.0

    # ------------------------------------------------------------------ the loop
    def _admit(self) -> bool:
        return (len(self.in_flight) < self.concurrency
                and self.started < (self.steps_done + self.ahead + 1) * self.batch_size)

    def _next_unit(self) -> Unit:
        if self._queue:
            return self._queue.popleft()
        while True:
            pos = self.next_pos
            units = [(pos, k) for k in range(self.group_size)]
            self.next_pos += 1
            todo = [u for u in units if u not in self._skip]
            if todo:
                self._queue.extend(todo[1:])
                return todo[0]

    async def _run_unit(self, unit: Unit) -> None:
        pos, k = unit
        with self._lock:
            policy_step = self.step_offset + self.steps_done
        task = self.stream[pos]
        task = dataclasses.replace(task, prompt_id=f"{task.prompt_id}@{pos}",
                                   meta={**task.meta, "data_pos": pos, "sample": k, "policy_step": policy_step})
        traj = await run_one(self.engine, self.env_factory, task, self.formatter, self.loop_cfg,
                             activity=self.activity)
        traj.info.update(data_pos=pos, sample=k, policy_step=policy_step)
        with self._lock:
            self.in_flight.discard(unit)
            self.finished += 1
            if not traj.trainable:
                # Recorded by the buffer, never trained on: it must not use up a batch's admission
                # budget, or a synchronous run would wait forever for a batch that cannot fill.
                self.failed += 1
                self.started -= 1
                self.failed_in_a_row += 1
            else:
                self.failed_in_a_row = 0
        self.on_done(traj)
        if not traj.trainable:
            await self._check_failing(traj)

    async def _check_failing(self, traj: Trajectory) -> None:
        """Stop instead of spinning when episodes keep failing: a dead engine would otherwise turn
        the whole prompt stream into failed trajectories. The trainer sees `.error` and stops."""
        n = self.failed_in_a_row
        if n < self.failure_threshold or self.error is not None:
            return
        try:
            healthy = await asyncio.wait_for(self.engine.health(), timeout=30)
        except Exception as e:  # noqa: BLE001 - an engine that cannot answer is unhealthy
            healthy, traj.info["health_error"] = False, repr(e)
        if not healthy:
            self.error = RuntimeError(f"the rollout engine is unhealthy after {n} failed episodes in a row "
                                      f"(last error: {traj.error})")
        elif n >= 4 * self.failure_threshold:
            self.error = RuntimeError(f"{n} episodes in a row failed with a healthy engine; last error: {traj.error}")
        if self.error is not None:
            self._stop.set()

    async def _main(self) -> None:
        tasks: set[asyncio.Task] = set()
        try:
            while not self._stop.is_set():
                with self._lock:
                    admit = self._admit()
                    unit = self._next_unit() if admit else None
                    if unit is not None:
                        self.in_flight.add(unit)
                        self.started += 1
                if unit is not None:
                    t = asyncio.create_task(self._run_unit(unit))
                    tasks.add(t)
                    t.add_done_callback(self._on_task_done(tasks))
                    continue
                self._wake.clear()
                waiter = asyncio.create_task(self._wake.wait())
                stopper = asyncio.create_task(self._stop.wait())
                await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED, timeout=1.0)
                waiter.cancel()
                stopper.cancel()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _on_task_done(self, tasks: set):
        def done(t: asyncio.Task) -> None:
            tasks.discard(t)
            if not t.cancelled() and t.exception() is not None and self.error is None:
                self.error = t.exception()  # on_done raised (a trainer-side bug): surface it
                self._stop.set()
            self._wake.set()
        return done


class ReplaySource:
    """Stands in for the driver when `trainer.replay` names a trajectory file: the file's
    trajectories enter the buffer in file order, and there is no rollout engine to sync."""

    def __init__(self, path, put: Callable[[Trajectory], None], fresh: bool):
        from megatron_sao.trajectory import load_trajectories

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

    def stop(self, timeout: float = 0.0) -> None:
        pass
