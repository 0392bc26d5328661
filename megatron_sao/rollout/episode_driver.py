"""The episode driver: keeps single-rollout episodes in flight on every server and feeds the buffer.

It runs an asyncio loop in a background thread of the trainer's rank 0 (docs/architecture.md,
Processes). Each unit of work is one episode of one prompt (``prompts.Unit``), placed on a server by
the ``ServerPool`` and kept there for all its turns.

Admission control (after AReaL's bound on how far rollouts run ahead of training): an episode may
start only while ``started_units < (steps_done + ahead + 1) * batch_size``, where ``steps_done`` counts
batches the trainer has finished (including weight sync). ``ahead = 0`` is the synchronous mode (one
batch, then a barrier); the asynchronous mode uses ``ahead = max_staleness``, so no trajectory is
started more than ``max_staleness`` steps before it is trained on. Units handed back by the buffer
(dropped as stale) go to the *front* of the queue: a long trajectory that went stale is retried next.

Server failures: a health check runs every ``health_interval_s``, and right away when an episode's
generate raised (``end_reason == "engine_error"``). A server that fails it is taken out of service; its
in-flight episodes are cancelled and re-run from their first turn on the remaining servers (counted in
``rollout/episodes_rerun``), never handed to the buffer half-done. With no server left no episode starts,
and the driver waits ``server_deadline_s`` for one to come back (the node supervisor restarts a server
that exited, slurm/common.sh); past it, it stops with an error naming every server and why it died (the
episodes it could not run stay queued for a resume), and the trainer writes a checkpoint and exits.
A dead server stays under health checks; one that answers again rejoins through the next weight update
(``ServerPool.revive``: never at an old weight version). With none in service the trainer does not wait
for a step to end: ``needs_rejoin`` asks it for an update of its current weights to the rejoining ones.
Start-up: with a pool whose servers are still starting (``ServerPool(starting=True)``: the trainer does not
wait for its `vllm serve`s before it builds its models), each server's /health is polled every
``START_POLL_S`` until it answers and the server comes up (``ServerPool.up``); no episode starts
before ``start_min_servers`` are (0: all of them; the hold ends early only when no server is left
starting or rejoining: on a resume, one that comes up after the resumed push gets those weights first).
A server that has not answered ``start_timeout_s`` after the start stops the run with an
error naming every such URL.
Episodes that fail on a healthy server are ordinary failed trajectories, and the circuit breaker stops
the run when they keep coming (``max(8, concurrency)`` in a row with no healthy server, or four times
that with healthy ones).

Data position for resume: ``next_pos`` plus the units in flight; the trainer checkpoints both, and on
resume re-runs in-flight units whose trajectory did not reach the buffer's directory. The units whose
trajectory the buffer restored (``skip``) count as started: they fill the admission window as they did
before the stop. Each episode's task carries ``meta["policy_step"]``: the trainer steps finished when it
started (``step_offset + steps_done``), which non-stationary environments read; it is also recorded in
``traj.info``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

from megatron_sao.envs.base import Task
from megatron_sao.rollout.agent_loop import AgentLoopConfig, EngineActivity, run_unit
from megatron_sao.rollout.prompts import PromptStream, Unit, unit_of
from megatron_sao.rollout.server_pool import ServerPool, ServerSlot
from megatron_sao.trajectory import Trajectory

logger = logging.getLogger(__name__)


class EpisodeDriver:
    START_POLL_S = 1.0  # /health polls of a starting server (a refused connection answers at once)

    def __init__(self, pool, env_factory: Callable[[Task], Any], stream: PromptStream, formatter,
                 loop_cfg: AgentLoopConfig, on_done: Callable[[Trajectory], None], *, batch_size: int,
                 ahead: int, concurrency: int, group_size: int = 1, next_pos: int = 0,
                 requeue: list[Unit] | None = None, skip: set[Unit] | None = None, step_offset: int = 0,
                 health_interval_s: float = 10.0, health_timeout_s: float = 30.0, server_deadline_s: float = 300.0,
                 start_timeout_s: float = 1800.0, start_min_servers: int = 1, endpoint=None):
        self.pool = pool if isinstance(pool, ServerPool) else ServerPool([pool])
        self.env_factory, self.stream, self.formatter = env_factory, stream, formatter
        self.loop_cfg, self.on_done = loop_cfg, on_done
        self.endpoint = endpoint  # the agent endpoint harness environments reach the policy through (or None)
        self.batch_size, self.ahead, self.concurrency, self.group_size = batch_size, ahead, concurrency, group_size
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
        # With health checks off nothing could notice a server coming back: stop at once then.
        self.server_deadline_s = server_deadline_s if health_interval_s > 0 else 0.0
        self._all_dead_since: float | None = None  # monotonic time the last server went out of service
        self.start_timeout_s = start_timeout_s  # for the pool's starting servers to answer /health
        n = len(self.pool.slots)
        self.start_min_servers = min(start_min_servers or n, n)
        self._start_held = bool(self.pool.starting())  # until start_min_servers are up (_holding_start)
        self.next_pos = next_pos
        self._queue: collections.deque[Unit] = collections.deque(requeue or [])
        self._skip = set(skip or ())  # units whose trajectory is already in the buffer (resume)
        self.in_flight: set[Unit] = set()
        # Units started since this driver was created (admission counter). A resumed run's buffer already
        # holds `skip`'s trajectories, waiting for the steps ahead: they take their place in the window, or
        # the driver would run ahead of training by that many more and the lag grow past the bound.
        self.started = len(self._skip)
        self.steps_done = 0  # steps finished since this driver was created (admission is relative to it)
        self.step_offset = step_offset  # trainer steps finished before it (resume), for policy_step
        self.finished = 0
        self.failed = 0
        self.activity = EngineActivity()
        self.failed_in_a_row = 0
        self.failure_threshold = max(8, concurrency)
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._running: dict[Unit, tuple[asyncio.Task, ServerSlot]] = {}
        self._rerun: set[Unit] = set()  # cancelled because their server died: run them again
        self._tasks: set[asyncio.Task] = set()
        self._closing = False
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
            except BaseException as e:  # reported to the trainer through .error
                self.error = e
            finally:
                self.loop.close()

        self._thread = threading.Thread(target=run, name="rollout-driver", daemon=True)
        self._thread.start()
        ready.wait()

    def submit(self, coro):
        """Schedule a coroutine on the driver's loop from another thread; return its concurrent Future."""
        if self.loop is None or not self._thread.is_alive():
            coro.close()
            raise RuntimeError(f"the rollout driver is not running (error: {self.error!r})")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro, timeout: float | None = None):
        """Run a coroutine on the driver's loop from the trainer thread and wait for its result."""
        return self.submit(coro).result(timeout)

    def step_finished(self) -> None:
        with self._lock:
            self.steps_done += 1
        self._poke()

    def requeue(self, traj: Trajectory) -> None:
        """The buffer dropped ``traj`` as stale: its episode runs again. An earlier segment of a harness
        episode is only dropped (its episode's end, dropped or trained, decides)."""
        if traj.ends_episode:
            self._requeue_unit(unit_of(traj))

    def _requeue_unit(self, unit: Unit) -> None:
        with self._lock:
            self.in_flight.discard(unit)
            self._queue.appendleft(unit)
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
    @property
    def needs_rejoin(self) -> bool:
        """A dead server answers again and nothing else would bring it in soon: no server is in service, or
        the start is held for it (a resume's server that came up after the resumed push, ``ServerPool.up``;
        without this the first episodes would run on the others and it would wait for a step's update)."""
        return self.error is None and bool(self.pool.rejoinable()) and (not self.pool.alive() or self._holding_start())

    @property
    def awaiting_server(self) -> bool:
        """No server in service and ``server_deadline_s`` (or, while servers are starting,
        ``start_timeout_s``) not yet passed: a batch may still come once one is back (restarted by its
        node) or up, so the trainer's batch wait must not give up meanwhile."""
        if self.error is not None:
            return False
        return self._holding_start() or (not self.pool.alive() and (
            self._all_dead_since is not None or bool(self.pool.starting())))

    def _holding_start(self) -> bool:
        """At the start: fewer than ``start_min_servers`` in service while others are still starting or
        rejoining (up after a resume's push, they serve once they have the resumed weights)."""
        if self._start_held and (len(self.pool.alive()) >= self.start_min_servers
                                 or not (self.pool.starting() or self.pool.rejoinable())):
            self._start_held = False
            if self.start_min_servers > 1:
                logger.info("%d rollout servers in service (rollout.start_min_servers=%d): episodes start",
                            len(self.pool.alive()), self.start_min_servers)
        return self._start_held

    def _admit(self) -> bool:
        return (bool(self.pool.alive()) and not self._holding_start() and len(self.in_flight) < self.concurrency
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
        slot = self.pool.place()
        if slot is None:  # every server died since admission; the error is already set
            self._requeue_unit(unit)
            return
        pos, k = unit
        with self._lock:
            policy_step = self.step_offset + self.steps_done
        task = self.stream[pos]
        task = dataclasses.replace(task, prompt_id=f"{task.prompt_id}@{pos}",
                                   meta={**task.meta, "data_pos": pos, "sample": k, "policy_step": policy_step})
        engine = self.pool.pin(slot)
        self._running[unit] = (asyncio.current_task(), slot)
        finished = False
        try:
            trajs = await run_unit(engine, self.env_factory, task, self.formatter, self.loop_cfg,
                                   activity=self.activity, endpoint=self.endpoint)
            traj = trajs[-1]  # the one that ends the episode (a harness episode may have earlier segments)
            if traj.info.get("end_reason") == "engine_error" and not await self.pool.check(slot, self.health_timeout_s):
                await self._server_failed(slot, f"unhealthy after a request of an episode failed ({traj.error})")
                self._rerun_unit(unit)  # on another server, or on one that comes back
                return
            finished = True
        except asyncio.CancelledError:
            if unit in self._rerun:  # its server died: run it again elsewhere, from the start
                self._rerun_unit(unit)
                return
            raise
        finally:
            self._running.pop(unit, None)
            self.pool.unpin(slot, finished)
        for t in trajs:
            t.info.update(data_pos=pos, sample=k, policy_step=policy_step, server=slot.label)
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
        for t in trajs:  # segments in order, the episode's end last (resume: prompts.complete_units)
            self.on_done(t)
        if not traj.trainable:
            await self._check_failing(traj)

    def _rerun_unit(self, unit: Unit) -> None:
        self._rerun.discard(unit)
        self.pool.reruns += 1
        self._requeue_unit(unit)

    async def _server_failed(self, slot: ServerSlot, reason: str) -> None:
        """Take ``slot`` out of service and re-run its episodes; stop when no server is left."""
        if self._closing:  # the engines are being closed on purpose (rollout_side.close): not a failure
            return
        if not self.pool.mark_dead(slot, reason):
            return
        me = asyncio.current_task()
        for unit, (task, s) in list(self._running.items()):
            if s is slot and task is not me:
                self._rerun.add(unit)
                task.cancel()
        if not self.pool.alive() and self.error is None:
            self._all_dead_since = time.monotonic()
            if self.server_deadline_s > 0:
                logger.error("no rollout server in service; waiting up to %gs (rollout.server_deadline_s) for one "
                             "to come back", self.server_deadline_s)
            self._check_deadline()

    def _check_deadline(self) -> None:
        """Stop the run when no server has been in service for ``server_deadline_s``."""
        if self.pool.alive():
            self._all_dead_since = None
            return
        # While servers are starting, start_timeout_s bounds the wait for them instead.
        if self.error is None and self._all_dead_since is not None and not self.pool.starting() \
                and time.monotonic() - self._all_dead_since >= self.server_deadline_s:
            self.error = RuntimeError(f"every rollout server is out of service (for {self.server_deadline_s:g}s, "
                                      "rollout.server_deadline_s: the rollout engine is unhealthy): "
                                      f"{self.pool.describe_dead()}")
            self._stop.set()

    def servers_failed(self, failed: dict[int, str]) -> None:
        """Thread-safe: take servers out of service (e.g. after a failed weight update)."""
        async def go():
            for i, reason in failed.items():
                await self._server_failed(self.pool.slots[i], reason)
        self.call(go())

    async def _monitor_health(self) -> None:
        # Every server is checked in its own task, one at a time per server: a hung one (a frozen `vllm
        # serve`, its check running out health_timeout_s) must hold back neither the checks that would
        # find another live server dead nor those that would see a dead one answer again (it may rejoin
        # at the next weight update, server_pool).
        checks: dict[int, asyncio.Task] = {}
        try:
            while not self._stop.is_set():
                await asyncio.sleep(self.health_interval_s)
                for slot in self.pool.slots:
                    if slot.index in checks and not checks[slot.index].done():
                        continue
                    if slot.alive:
                        checks[slot.index] = asyncio.create_task(self._check_live(slot))
                    elif slot.rejoin_refused is None and not slot.starting:  # starting: _await_start
                        checks[slot.index] = asyncio.create_task(self._recheck_dead(slot))
                self._check_deadline()
        finally:
            for t in checks.values():
                t.cancel()
            await asyncio.gather(*checks.values(), return_exceptions=True)

    async def _await_start(self) -> None:
        """Bring every starting server up once it answers /health; stop the run naming those that
        have not answered ``start_timeout_s`` after the start."""
        async def one(slot: ServerSlot) -> None:
            while not await self.pool.check(slot, self.health_timeout_s):
                await asyncio.sleep(self.START_POLL_S)
            self.pool.up(slot)
            self._wake.set()  # admission may start

        waiting = [asyncio.create_task(one(s)) for s in self.pool.starting()]
        left = max(0.0, self.start_timeout_s - (time.monotonic() - self._t_start))
        _, late = await asyncio.wait(waiting, timeout=left)
        for t in late:
            t.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        if late and self.error is None:
            self.error = RuntimeError(
                f"rollout servers never answered /health within {self.start_timeout_s:g}s of the start "
                f"(rollout.server_start_timeout_s): {', '.join(s.label for s in self.pool.starting())}")
            self._stop.set()

    async def _check_live(self, slot: ServerSlot) -> None:
        if not await self.pool.check(slot, self.health_timeout_s):
            await self._server_failed(slot, f"health check failed (every {self.health_interval_s:g}s)")

    async def _recheck_dead(self, slot: ServerSlot) -> None:
        healthy = await self.pool.check(slot, self.health_timeout_s)
        if slot.alive or slot.rejoin_refused is not None:
            return  # revived or refused by a weight update meanwhile
        if healthy and not slot.healthy_again:
            logger.info("rollout server %s answers its health check again; it rejoins at the next weight update",
                        slot.label)
        slot.healthy_again = healthy

    async def _check_failing(self, traj: Trajectory) -> None:
        """Stop instead of spinning when episodes keep failing: a dead engine would otherwise turn
        the whole prompt stream into failed trajectories. The trainer sees `.error` and stops."""
        n = self.failed_in_a_row
        if n < self.failure_threshold or self.error is not None:
            return
        live = self.pool.alive()
        healthy = [s for s, ok in zip(live, await asyncio.gather(*(self.pool.check(s, self.health_timeout_s)
                                                                   for s in live))) if ok]
        if not healthy:
            self.error = RuntimeError(f"the rollout engine is unhealthy after {n} failed episodes in a row "
                                      f"(last error: {traj.error})")
        elif n >= 4 * self.failure_threshold:
            self.error = RuntimeError(f"{n} episodes in a row failed with a healthy engine; last error: {traj.error}")
        if self.error is not None:
            self._stop.set()

    async def cancel_episodes(self) -> None:
        """Stop admitting and cancel every running episode (before the engines are closed)."""
        self._closing = True
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _main(self) -> None:
        tasks = self._tasks
        if self.endpoint is not None:  # on this loop: a harness's request reaches its engine without a thread hop
            await self.endpoint.start()
        monitor = asyncio.create_task(self._monitor_health()) if self.health_interval_s > 0 else None
        starting = asyncio.create_task(self._await_start()) if self.pool.starting() else None
        try:
            while not self._stop.is_set():
                with self._lock:
                    admit = self._admit() and not self._closing
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
            helpers = [t for t in (monitor, starting) if t is not None]
            for t in [*tasks, *helpers]:
                t.cancel()
            await asyncio.gather(*tasks, *helpers, return_exceptions=True)
            if self.endpoint is not None:
                await self.endpoint.stop()

    def _on_task_done(self, tasks: set):
        def done(t: asyncio.Task) -> None:
            tasks.discard(t)
            if not t.cancelled() and t.exception() is not None and self.error is None:
                self.error = t.exception()  # on_done raised (a trainer-side bug): surface it
                self._stop.set()
            self._wake.set()
        return done
