"""Every rollout server in use: placement, per-server concurrency, health, and what each one did.

Placement: a new episode goes to the live server with the fewest outstanding generate requests (sent
or waiting for a slot), ties broken by fewer pinned episodes, then by index, and keeps that server for
all of its turns: the server's prefix cache holds the episode's history, so a later turn only prefills
the new observation (verl's and slime's routers pin a conversation for the same reason).

Per-server concurrency: at most ``max_num_seqs`` generate requests are in flight on one server, the
value its ``vllm serve --max-num-seqs`` was started with (``rollout.max_num_seqs``; the launch plan
passes the same number to both). Further requests wait here, where the wait is visible, instead of
queueing inside vLLM against the request timeout.

Start-up: the trainer starts while its `vllm serve`s still load the model (the two cold starts overlap).
A pool made with ``starting=True`` has every server out of service at first, as "not up yet"; the
driver polls each one's /health and brings it in (``up``) once it answers. While no weight update
has begun the servers hold the weights the trainer starts from (the base model, version 0), so one
that comes up then enters service at once; after that (a resume pushes the resumed weights first)
it is a rejoining server like a restarted one (below) and gets the whole update before it serves.

A server marked dead (failed health check, failed weight update) gets no new episodes; the driver
re-runs its in-flight episodes elsewhere. Nothing here falls back silently: every death is logged
with its reason and counted in ``metrics()``.

Re-admission: the driver keeps health-checking dead servers; one that answers again (a `vllm serve`
restarted by the node supervisor, a node that came back from an overload) is marked ``healthy_again``.
It is not given episodes on that alone, since it holds an older weight version: the next weight update
includes it (``update_members``), and ``WeightSync`` re-forms the transfer group with it (the restarted
process is a new peer), and only a server that takes the whole update (and passes the weight check, when on) is
revived (``revive``), at the same version as every other live server. With no server in service the
update goes to the rejoining ones alone (the trainer pushes its current version while it waits for a
batch). A rejoin that fails (an update step or the weight check ran out its timeout, the check disagreed)
leaves the server out until it answers its health check again, and it is tried at the next update after
that, at most ``rejoin_attempts`` times in all (``rollout.rejoin_attempts``): a restarted `vllm serve`
may be slow on its first requests, so one timeout is no proof it is broken, but a server that hangs in
every update must not cost a sync timeout every step, so after the last attempt it stays out for the
rest of the run.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from megatron_sao.rollout.engines.protocol import GenerationResult, RolloutEngine, SamplingParams

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class ServerSlot:
    index: int
    engine: RolloutEngine
    label: str  # the server URL (or the engine's name)
    cap: int | None  # max generate requests in flight (max_num_seqs); None = unbounded
    alive: bool = True
    dead_reason: str | None = None
    healthy_again: bool = False  # dead, but its health check passes: a candidate for the next update
    rejoin_failures: int = 0  # failed rejoins so far (each one waits for a health answer before the next)
    rejoin_refused: str | None = None  # why its last allowed rejoin failed (it is not tried again)
    starting: bool = False  # not up yet: no /health answer since the start (module docstring)
    ever_served: bool = True  # False for a server that came up after a resume's push, until its first update
    outstanding: int = 0  # generate requests sent or waiting for a slot
    in_flight: int = 0  # generate requests sent (<= cap)
    max_in_flight: int = 0  # the most ever seen at once (a check that the cap held)
    episodes: int = 0  # episodes pinned to it now
    started: int = 0  # episodes placed on it since start
    finished: int = 0  # episodes it completed (trajectory handed over)
    _sem: asyncio.Semaphore | None = field(default=None, repr=False)

    def semaphore(self) -> asyncio.Semaphore | None:
        if self.cap is not None and self._sem is None:
            self._sem = asyncio.Semaphore(self.cap)  # created in the loop that uses it
        return self._sem


class PinnedEngine:
    """The engine an episode sees: one server's engine, with its slot's request cap and counters."""

    def __init__(self, slot: ServerSlot) -> None:
        self.slot = slot
        self.name = slot.label

    @property
    def version(self) -> int:
        return self.slot.engine.version

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationResult:
        slot = self.slot
        if not slot.alive:
            raise RuntimeError(f"rollout server {slot.label} is out of service: {slot.dead_reason}")
        slot.outstanding += 1
        try:
            sem = slot.semaphore()
            if sem is None:
                return await self._send(prompt_ids, sampling)
            async with sem:
                return await self._send(prompt_ids, sampling)
        finally:
            slot.outstanding -= 1

    async def _send(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationResult:
        slot = self.slot
        slot.in_flight += 1
        slot.max_in_flight = max(slot.max_in_flight, slot.in_flight)
        try:
            return await slot.engine.generate(prompt_ids, sampling)
        finally:
            slot.in_flight -= 1

    async def health(self) -> bool:
        return await self.slot.engine.health()


class ServerPool:
    """The rollout servers of one run (see the module docstring)."""

    def __init__(self, engines: list[RolloutEngine], labels: list[str] | None = None,
                 max_num_seqs: int | None = None, starting: bool = False, rejoin_attempts: int = 3) -> None:
        if not engines:
            raise ValueError("ServerPool needs at least one rollout engine")
        if rejoin_attempts < 1:
            raise ValueError(f"rejoin_attempts must be >= 1 (rollout.rejoin_attempts), got {rejoin_attempts}")
        self.rejoin_attempts = rejoin_attempts
        if max_num_seqs is not None and max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1 (rollout.max_num_seqs), got {max_num_seqs}")
        labels = labels or [getattr(e, "url", None) or getattr(e, "name", f"engine{i}") for i, e in enumerate(engines)]
        if len(labels) != len(engines):
            raise ValueError(f"{len(labels)} labels for {len(engines)} engines")
        self.slots = [ServerSlot(i, e, label, max_num_seqs) for i, (e, label) in enumerate(zip(engines, labels))]
        for slot in self.slots if starting else ():
            slot.alive, slot.starting, slot.dead_reason = False, True, "not up yet (no /health answer since the start)"
        self.base_current = True  # no weight update has begun: the servers' own weights are the trainer's
        self.deaths = 0
        self.revivals = 0
        self.reruns = 0  # episodes re-run on another server after theirs died

    @property
    def engines(self) -> list[RolloutEngine]:
        return [s.engine for s in self.slots]

    def alive(self) -> list[ServerSlot]:
        return [s for s in self.slots if s.alive]

    def place(self) -> ServerSlot | None:
        """The live server a new episode should go to, or None when every server is dead."""
        live = self.alive()
        if not live:
            return None
        return min(live, key=lambda s: (s.outstanding, s.episodes, s.index))

    def pin(self, slot: ServerSlot) -> PinnedEngine:
        slot.episodes += 1
        slot.started += 1
        return PinnedEngine(slot)

    def unpin(self, slot: ServerSlot, finished: bool) -> None:
        slot.episodes -= 1
        slot.finished += int(finished)

    def mark_dead(self, slot: ServerSlot, reason: str) -> bool:
        """Take ``slot`` out of service; True if it was alive (the caller re-runs its episodes)."""
        if not slot.alive:
            return False
        slot.alive, slot.dead_reason, slot.healthy_again = False, reason, False
        self.deaths += 1
        logger.error("rollout server %s is out of service (%s); %d of %d servers left", slot.label, reason,
                     len(self.alive()), len(self.slots))
        return True

    def starting(self) -> list[ServerSlot]:
        return [s for s in self.slots if s.starting]

    def up(self, slot: ServerSlot) -> None:
        """A starting server answered /health: in service if it holds the trainer's weights, else it
        rejoins at the next weight update (module docstring)."""
        slot.starting = False
        if self.base_current:
            slot.alive, slot.dead_reason = True, None
            logger.info("rollout server %s is up: in service (%d of %d)", slot.label, len(self.alive()),
                        len(self.slots))
        else:
            slot.healthy_again, slot.ever_served = True, False
            logger.info("rollout server %s is up; it enters service with the next weight update", slot.label)

    def rejoinable(self) -> list[ServerSlot]:
        """Dead servers whose health check passes again and whose rejoin was never refused."""
        return [s for s in self.slots if not s.alive and s.healthy_again and s.rejoin_refused is None]

    def update_members(self) -> tuple[list[int], list[int]]:
        """Who takes the next weight update: (servers in service, rejoining servers), as indices.

        A rejoining server is a dead one that answers /health again: usually a restarted process (the
        node supervisor restarts a `vllm serve` that exited, slurm/common.sh), which holds the base
        model and no transfer group. It gets the complete update like every other member, on a new
        transfer group (``WeightSync`` re-forms the group when the members change), and serves again only if
        it took all of it."""
        return [s.index for s in self.alive()], [s.index for s in self.rejoinable()]

    def revive(self, slot: ServerSlot, version: int) -> None:
        """Back in service after it took the whole update to ``version`` (see the module docstring); a
        server's first entry after a resume is not a revival (rollout/server_revivals counts comebacks)."""
        if slot.ever_served:
            logger.warning("rollout server %s is back in service at weight version %d (it was out: %s)",
                           slot.label, version, slot.dead_reason)
            self.revivals += 1
        else:
            logger.info("rollout server %s is in service at weight version %d", slot.label, version)
        slot.alive, slot.dead_reason, slot.healthy_again, slot.ever_served = True, None, False, True

    def rejoin_failed(self, slot: ServerSlot, reason: str) -> None:
        """A rejoin that did not take: tried again once the server answers its health check again, until
        the ``rejoin_attempts``-th failure refuses it for good (see the module docstring)."""
        slot.rejoin_failures += 1
        slot.healthy_again = False  # the next health answer makes it a candidate again
        n, most = slot.rejoin_failures, self.rejoin_attempts
        if n >= most:
            slot.rejoin_refused = reason
            logger.error("rollout server %s answered its health check again but failed to rejoin %d of %d times "
                         "(last: %s); it stays out of service for the rest of the run", slot.label, n, most, reason)
        else:
            logger.warning("rollout server %s failed to rejoin (%s; attempt %d of %d); it is tried again at the "
                           "next weight update after it answers its health check", slot.label, reason, n, most)

    async def check(self, slot: ServerSlot, timeout_s: float) -> bool:
        """One health check; an engine that does not answer in time is unhealthy."""
        try:
            return bool(await asyncio.wait_for(slot.engine.health(), timeout_s))
        except Exception:  # an engine that cannot answer is unhealthy
            return False

    def describe_dead(self) -> str:
        return "; ".join(f"{s.label}: {s.dead_reason}" for s in self.slots if not s.alive)

    def metrics(self) -> dict:
        """What each server did so far (cumulative; logged every step)."""
        return {
            "rollout/servers_alive": len(self.alive()),
            "rollout/server_deaths": self.deaths,
            "rollout/server_revivals": self.revivals,
            "rollout/episodes_rerun": self.reruns,
            "rollout/episodes_by_server": {s.label: s.finished for s in self.slots},
            "rollout/episodes_started_by_server": {s.label: s.started for s in self.slots},
            "rollout/version_by_server": {s.label: int(s.engine.version) for s in self.slots},
            "rollout/max_in_flight_by_server": {s.label: s.max_in_flight for s in self.slots},
        }
