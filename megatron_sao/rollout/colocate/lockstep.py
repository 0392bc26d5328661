"""A rollout phase of the colocated engines: rounds in lockstep over every trainer rank.

Every rank enters ``serve_phase`` together (the trainer calls it where it would wait for a batch).
Rank 0 leads. Each round it broadcasts the new generate requests of every engine (from the hub, in
arrival order); each rank adds its engine's share to its shard and steps it up to
``steps_per_round`` times (or until the engine is empty); each rank reports what finished; rank 0
gathers the reports, checks that the ranks of every engine agree (a diverged engine is an error,
never a silent wrong sample) and resolves the waiting generate calls. Engines with no requests idle
through the round; a round ends when the slowest engine did its steps, and new requests (the next
turn of an episode whose environment just answered) join at the next round, so generation is
continuously batched at a granularity of ``steps_per_round`` decode steps.

Rank 0 ends the phase when ``until()`` says so (the trainer: a batch is in the buffer). It stops
handing out new requests, lets every engine finish the requests it holds (a turn is never split
across a weight update, and a sleeping engine must hold none: its KV cache is discarded) and
broadcasts the end. Requests that arrived meanwhile wait in the hub for the next phase.

The control traffic (a few pickled lists per round) goes over a gloo group of the world, created
for it: host memory only, and the NCCL world the trainer and vLLM use is never touched. While rank 0
waits for work (every episode is in its environment) it re-broadcasts an empty round every
``heartbeat_s``, so no rank sits in one collective for longer than that.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_sao.rollout.colocate.hub import RequestHub
from megatron_sao.rollout.colocate.layout import EngineLayout
from megatron_sao.rollout.engines.protocol import SamplingParams
from megatron_sao.rollout.engines.routes import unpacked_routes


class EngineDiverged(RuntimeError):
    """The ranks of one engine reported different outputs for the same round."""


@dataclass
class PhaseStats:
    """What one rollout phase did (rank 0's view of every engine)."""

    seconds: float = 0.0
    drain_seconds: float = 0.0
    rounds: int = 0
    requests: dict[int, int] = field(default_factory=dict)  # engine -> requests finished
    tokens: dict[int, int] = field(default_factory=dict)  # engine -> tokens generated

    def as_metrics(self, prefix: str = "colocate/") -> dict:
        return {f"{prefix}drain_s": self.drain_seconds, f"{prefix}rounds": self.rounds,
                f"{prefix}requests_by_engine": {str(e): n for e, n in sorted(self.requests.items())},
                f"{prefix}tokens_by_engine": {str(e): n for e, n in sorted(self.tokens.items())}}


def _run_round(shard, layout: EngineLayout, cmd: dict) -> dict:
    """This rank's part of one round: add its engine's requests, step, report what finished."""
    report = {"engine": layout.engine, "rank": layout.rank, "finished": [], "failed": [], "unfinished": 0,
              "error": None}
    try:
        for rid, prompt, sampling, seed in cmd["new"].get(layout.engine, []):
            try:
                shard.add(rid, prompt,
                          SamplingParams(**{**sampling, "stop_token_ids": tuple(sampling["stop_token_ids"])}), seed)
            except ValueError as e:
                # e.g. a prompt longer than max_model_len: that request fails, the same on every rank
                report["failed"].append((rid, f"{type(e).__name__}: {e}"))
        for _ in range(cmd["steps"]):
            if not shard.unfinished():
                break
            report["finished"] += shard.step()
        report["unfinished"] = shard.unfinished()
    except Exception as e:  # reported: rank 0 ends the phase on every rank
        report["error"] = f"rank {layout.rank}: {type(e).__name__}: {e}"
    return report


class RoundLeader:
    """Rank 0: decides every round, checks the engines' ranks agree, resolves the hub's futures."""

    def __init__(self, hub: RequestHub, layout: EngineLayout, until: Callable[[], bool], version: int, *,
                 steps_per_round: int, heartbeat_s: float, idle_wait_s: float = 0.2) -> None:
        self.hub, self.layout, self.until, self.version = hub, layout, until, version
        self.steps, self.heartbeat_s, self.idle_wait_s = steps_per_round, heartbeat_s, idle_wait_s
        self.held = [0] * layout.engines  # requests inside each engine after the last round
        self.draining_since: float | None = None
        self.stats = PhaseStats()
        self.failed: str | None = None  # set by collect(): the next round ends the phase with it
        self._last_round = time.monotonic()

    def next_round(self) -> dict:
        while True:
            if self.failed is not None:
                return {"end": True, "error": self.failed}
            if self.draining_since is None and self.until():
                self.draining_since = time.monotonic()
            if self.draining_since is not None:
                if not any(self.held):
                    return {"end": True, "error": None}
                return self._round({})
            new = self.hub.take_new()
            if new or any(self.held):
                return self._round(new)
            if time.monotonic() - self._last_round >= self.heartbeat_s:
                return self._round({})
            self.hub.wait_for_requests(self.idle_wait_s)

    def _round(self, new: dict) -> dict:
        self._last_round = time.monotonic()
        self.stats.rounds += 1
        return {"end": False, "new": new, "steps": self.steps}

    def collect(self, reports: list[dict]) -> None:
        errors = [r["error"] for r in reports if r["error"]]
        if errors:
            raise RuntimeError("colocated engine failed: " + "; ".join(errors))
        for e in range(self.layout.engines):
            ranks = self.layout.ranks_of(e)
            lead = reports[ranks[0]]
            for r in ranks[1:]:
                other = reports[r]
                if (other["finished"], other["failed"], other["unfinished"]) != (
                        lead["finished"], lead["failed"], lead["unfinished"]):
                    raise EngineDiverged(
                        f"engine {e}: ranks {ranks[0]} and {r} disagree after the same round (finished "
                        f"{[x[0] for x in lead['finished']]} vs {[x[0] for x in other['finished']]}); the engine's "
                        "tensor-parallel ranks are no longer in lockstep")
            self.held[e] = lead["unfinished"]
            for rid, ids, lps, reason, routes in lead["finished"]:
                self.hub.finish(rid, ids, lps, reason, self.version, unpacked_routes(routes))
                self.stats.requests[e] = self.stats.requests.get(e, 0) + 1
                self.stats.tokens[e] = self.stats.tokens.get(e, 0) + len(ids)
            for rid, err in lead["failed"]:
                self.hub.fail(rid, err)


def serve_phase(shard, layout: EngineLayout, group, leader: RoundLeader | None) -> PhaseStats | None:
    """Every rank: run rounds until rank 0 ends the phase (module docstring). Rank 0 passes the leader
    and gets its stats; on any error every rank raises."""
    t0 = time.monotonic()
    while True:
        cmd = None
        if leader is not None:
            try:
                cmd = leader.next_round()
            except Exception as e:  # every rank must hear it, or they wait forever
                cmd = {"end": True, "error": f"{type(e).__name__}: {e}"}
        box = [cmd]
        dist.broadcast_object_list(box, src=0, group=group, device=torch.device("cpu"))  # a gloo (host) group
        cmd = box[0]
        if cmd["end"]:
            if cmd["error"]:
                raise RuntimeError(f"the colocated rollout phase stopped: {cmd['error']}")
            break
        report = _run_round(shard, layout, cmd)
        gathered = [None] * layout.world if leader is not None else None
        dist.gather_object(report, gathered, dst=0, group=group)
        if leader is not None:
            try:
                leader.collect(gathered)
            except Exception as e:  # ends the phase on every rank at the next broadcast
                leader.failed = f"{type(e).__name__}: {e}"
    if leader is None:
        return None
    leader.stats.seconds = time.monotonic() - t0
    if leader.draining_since is not None:
        leader.stats.drain_seconds = time.monotonic() - leader.draining_since
    return leader.stats
