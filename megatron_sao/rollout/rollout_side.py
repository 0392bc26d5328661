"""The rollout side of a run, as one object: every server, admission control, episodes, weight sync.

``RolloutSide`` owns the rollout engines (one per server), the ``ServerPool`` that places episodes on
them, the ``EpisodeDriver`` that keeps episodes in flight under admission control, and the
``WeightSync`` that updates every live server to the same version. The trainer hands it weights
(``push_weights``) and takes trajectories (through ``on_done``, into its buffer), nothing more; it
knows no server, URL or transport.

Weight updates stream (``weights/stream.py``): ``push_weights`` chooses the servers that take the update
and settles what happened to each; the bytes move bucket by bucket while the trainer produces the next.
A server that fails its update is taken out of service like a dead one (logged, counted; its episodes
re-run elsewhere); a weight check that fails, or no server left, stops the run. A dead server that
answers its health check again is included in the next update and revived if it takes all of it
(``ServerPool.revive``), so every server that generates holds the same version.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable

from megatron_sao.rollout.agent_loop import AgentLoopConfig, run_one
from megatron_sao.rollout.engines.protocol import RolloutEngine
from megatron_sao.rollout.episode_driver import EpisodeDriver
from megatron_sao.rollout.prompts import PromptStream, Unit
from megatron_sao.rollout.server_pool import ServerPool
from megatron_sao.trajectory import Trajectory
from megatron_sao.weights.buckets import WeightBucket
from megatron_sao.weights.stream import drain, stream_update
from megatron_sao.weights.sync import SyncMetrics, WeightSync, WeightSyncError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutSideConfig:
    batch_size: int  # trajectories per trainer step (admission unit)
    ahead: int  # steps rollouts may run ahead (0 = synchronous)
    concurrency: int  # episodes in flight over all servers
    group_size: int = 1
    max_num_seqs: int | None = None  # generate requests in flight per server (vllm serve --max-num-seqs)
    sync_timeout_s: float = 600.0  # each step of a weight update, per server
    check_weights: bool = False  # verify every server's log-probs after every update
    check_atol: float = 1e-3
    check_every: int = 1  # with check_weights: only the updates whose version is a multiple of this
    health_interval_s: float = 10.0
    health_timeout_s: float = 30.0
    server_deadline_s: float = 300.0  # with no server in service, how long to wait for one to come back
    # Servers still starting (not up until they answer /health), and how long they may take; None:
    # every engine is in service from the start (in-process and colocated engines).
    start_timeout_s: float | None = None
    start_min_servers: int = 1  # servers in service before the first episode starts (0: all)
    rejoin_attempts: int = 3  # failed rejoins before a revived server is left out for good (server_pool)


class RolloutSide:
    def __init__(self, engines: list[RolloutEngine], env_factory: Callable, stream: PromptStream, formatter,
                 loop_cfg: AgentLoopConfig, on_done: Callable[[Trajectory], None], cfg: RolloutSideConfig, *,
                 labels: list[str] | None = None, next_pos: int = 0, requeue: list[Unit] | None = None,
                 skip: set[Unit] | None = None, step_offset: int = 0, endpoint=None):
        self.cfg, self.formatter = cfg, formatter
        self.pool = ServerPool(engines, labels, cfg.max_num_seqs, starting=cfg.start_timeout_s is not None,
                               rejoin_attempts=cfg.rejoin_attempts)
        self.sync = WeightSync(self.pool.engines, cfg.sync_timeout_s, check=cfg.check_weights, atol=cfg.check_atol,
                               strict=False, labels=[s.label for s in self.pool.slots], check_every=cfg.check_every)
        self.driver = EpisodeDriver(self.pool, env_factory, stream, formatter, loop_cfg, on_done,
                                    batch_size=cfg.batch_size, ahead=cfg.ahead, concurrency=cfg.concurrency,
                                    group_size=cfg.group_size, next_pos=next_pos, requeue=requeue, skip=skip,
                                    step_offset=step_offset, health_interval_s=cfg.health_interval_s,
                                    health_timeout_s=cfg.health_timeout_s,
                                    server_deadline_s=cfg.server_deadline_s,
                                    start_timeout_s=cfg.start_timeout_s or 0.0,
                                    start_min_servers=cfg.start_min_servers, endpoint=endpoint)
        self.last_sync: SyncMetrics | None = None

    # ------------------------------------------------------------------ what the trainer reads
    @property
    def error(self) -> BaseException | None:
        return self.driver.error

    @property
    def needs_rejoin(self) -> bool:
        """No server in service and a restarted one answers: push the current weights (``push_weights``)."""
        return self.driver.needs_rejoin

    @property
    def awaiting_server(self) -> bool:
        """No server in service, ``rollout.server_deadline_s`` pending (``EpisodeDriver.awaiting_server``)."""
        return self.driver.awaiting_server

    @property
    def finished(self) -> int:
        return self.driver.finished

    @property
    def failed(self) -> int:
        return self.driver.failed

    @property
    def in_flight(self) -> set[Unit]:
        return self.driver.in_flight

    def start(self) -> None:
        self.driver.start()

    def step_finished(self) -> None:
        self.driver.step_finished()

    def requeue(self, traj: Trajectory) -> None:
        self.driver.requeue(traj)

    def state(self) -> dict[str, Any]:
        return self.driver.state()

    def waiting_on(self) -> str:
        """What episodes wait on besides the engines: the environment call in progress the longest ("" if none)."""
        return self.driver.activity.env_calls.describe_oldest()

    def engine_idle_fraction(self) -> float:
        return self.driver.engine_idle_fraction()

    def metrics(self) -> dict:
        m = self.pool.metrics()
        if self.last_sync is not None:
            m.update(self.last_sync.as_dict())
        return m

    # ------------------------------------------------------------------ weights
    def push_weights(self, buckets: Iterable[WeightBucket], version: int, *, check_tokens: list[int] | None = None,
                     check_prompt_len: int = 1, reference_logprobs: list[float] | None = None,
                     routed_reference: Callable[[dict[int, Any]], dict[int, list[float]]] | None = None
                     ) -> SyncMetrics:
        """Stream ``buckets`` (pulled here, on the caller's thread) to every live server as ``version``, and
        readmitted servers on probation; the check arguments as in ``weights.stream.stream_update``."""
        live, rejoin = self.driver.call(self._members())  # rejoin: dead servers that answer again (server_pool)
        if not live and not rejoin:
            drain(buckets)  # keep the trainer ranks' collectives paired
            if not self.pool.starting():
                raise RuntimeError(f"no rollout server left to update: {self.pool.describe_dead()}")
            # A resume before any server is up: each one gets this version when it comes up (it rejoins).
            logger.info("weights v%d: no rollout server is up yet; each gets them when it is", version)
            return SyncMetrics(version, 0.0, 0, 0.0)
        metrics = stream_update(self.sync, self.driver, buckets, version, live + rejoin, probation=rejoin,
                                wait_s=self.cfg.sync_timeout_s + 60.0,  # each step is bounded per server
                                check_tokens=check_tokens, check_prompt_len=check_prompt_len,
                                reference_logprobs=reference_logprobs, routed_reference=routed_reference)
        self.last_sync = metrics
        if rejoin:
            self._settle_rejoins(rejoin, metrics, version)
        if metrics.failed:
            failed = {i: f"weight update v{version} failed: {err}" for label, err in metrics.failed.items()
                      if (i := self.sync.labels.index(label)) not in rejoin}  # rejoins: settled above
            self.driver.servers_failed(failed)
            if self.driver.error is not None:
                raise WeightSyncError(f"weight sync v{version}: no rollout server left ({self.pool.describe_dead()})")
        return metrics

    async def _members(self) -> tuple[list[int], list[int]]:
        """On the driver's loop, where starting servers come up: from here on a server that comes up
        does not hold the trainer's weights (``ServerPool.up``)."""
        self.pool.base_current = False
        return self.pool.update_members()

    def _settle_rejoins(self, rejoin: list[int], metrics: SyncMetrics, version: int) -> None:
        """Revive each rejoining server that took the whole update; the others are tried again later, a
        bounded number of times (``ServerPool.rejoin_failed``)."""
        async def go():
            for i in rejoin:
                slot = self.pool.slots[i]
                why = metrics.failed.get(slot.label)
                if why is None:
                    self.pool.revive(slot, version)
                else:
                    self.pool.rejoin_failed(slot, why)
        self.driver.call(go())

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, tasks: list, env_factory: Callable, loop_cfg: AgentLoopConfig,
                 timeout_s: float | None = None) -> list[Trajectory]:
        """Run ``tasks`` (one episode each, in task order) over the live servers, on the driver's loop.
        Past ``timeout_s`` its episodes are cancelled (their servers unpinned) and TimeoutError raised."""
        fut = self.driver.submit(self.evaluation(tasks, env_factory, loop_cfg))
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"evaluation of {len(tasks)} tasks did not finish within {timeout_s:g}s "
                               f"(run.eval_timeout_s); servers alive: {len(self.pool.alive())} of "
                               f"{len(self.pool.slots)}") from None

    def evaluation(self, tasks: list, env_factory: Callable, loop_cfg: AgentLoopConfig):
        """The coroutine ``evaluate`` runs, for a caller that submits it and serves the engines meanwhile
        (the colocated placement: the engines generate only while every rank serves them)."""
        async def go() -> list[Trajectory]:
            sem = asyncio.Semaphore(loop_cfg.max_concurrency)

            async def one(task) -> Trajectory:
                async with sem:
                    slot = self.pool.place()
                    if slot is None:
                        raise RuntimeError(f"no rollout server left to evaluate on: {self.pool.describe_dead()}")
                    engine = self.pool.pin(slot)
                    try:
                        return await run_one(engine, env_factory, task, self.formatter, loop_cfg,
                                             endpoint=self.driver.endpoint)
                    finally:
                        self.pool.unpin(slot, finished=False)
            return list(await asyncio.gather(*(one(t) for t in tasks)))
        return go()

    # ------------------------------------------------------------------ shutdown
    def close(self, timeout: float = 30.0) -> None:
        """Cancel the episodes, close every engine (HTTP sessions, transfer groups, in-process engines),
        stop the loop."""
        if self.driver.loop is not None and self.driver._thread.is_alive():
            async def close_all():
                await self.driver.cancel_episodes()
                await asyncio.gather(self.sync.close(), *(e.close() for e in self.pool.engines),
                                     return_exceptions=True)
            try:
                self.driver.call(close_all(), timeout=timeout)
            except Exception as e:  # shutting down; report and go on
                logger.warning("closing the rollout engines failed: %r", e)
        self.driver.stop(timeout)
