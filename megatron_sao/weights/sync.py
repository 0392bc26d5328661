"""Stream the trainer's HF-named weight export to every rollout engine, with timeouts and a check mode.

The trainer exports its weights gathered across TP/EP/PP as an iterator of buckets of ``(hf_name,
tensor)``. An update is ``begin(version)``, ``send_bucket(bucket)`` per bucket, ``finish(version)``:
each step goes to all engines concurrently, each under ``asyncio.wait_for(timeout_s)``, and a bucket
is sent to every engine before the next one is asked for, so the caller never holds more than the
bucket in flight plus the one it is producing (``RolloutSide.push_weights`` overlaps the two). A hung
engine becomes a ``WeightSyncError`` naming it instead of a silent stall; a
timed-out engine may still be applying the update in its own thread or process: treat it as broken.

Servers that take weights by broadcast (``vllm serve``: nccl on GPU, gloo on CPU) share one transfer
group (``server_group.ServerTransferGroup``): rank 0 broadcasts each bucket once for all of them while
each receives it; the group is formed at the first update and reused, and re-formed when the set of
servers in the update changes (or a failure broke it). Engines without a group (the HF servers'
reload route, in-process engines) get each bucket per engine, concurrently.

An engine that fails is left out of the rest of that update and reported in ``SyncMetrics.failed``;
``strict=True`` (the default) raises at ``finish``. The rollout side runs with ``strict=False`` and
takes the failed servers out of service (their episodes re-run elsewhere), so every server that still
generates holds the same version.

Check mode (pitfall 3, silent MoE refit corruption): after an update, ``verify`` compares each
engine's log-probs of fixed tokens with reference log-probs the trainer computed for the same tokens
under the same weights, and raises with the worst positions if they differ by more than ``atol``.
``check_every`` N (``rollout.weight_sync_check_every``) checks only the updates whose version is a
multiple of N (``check_due``): the check costs a trainer forward and a scoring request per server.
Under routing replay an MoE's reference depends on the experts each engine chose for the check tokens
(a route flip between the two stacks is not a transfer error): the engines are scored first with their
routes (``score_routed``), the trainer computes each engine's reference with its routes replayed, and
``judge`` compares them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from megatron_sao.weights.buckets import WeightBucket, bucket_bytes


class UpdatableEngine(Protocol):
    """What a weight sync needs of an engine (every rollout engine has it: ``rollout/engines/protocol.py``).

    An engine that takes weights by broadcast in the shared transfer group also has ``group_transport``
    (the group's backend) and ``cfg.weight_transfer_master_address`` / ``cfg.weight_transfer_ports``;
    the check mode scores with ``score(token_ids, start)`` and, under routing replay, ``score_routed``.
    """

    version: int

    async def begin_weight_update(self, version: int) -> None: ...

    async def push_weight_bucket(self, bucket: WeightBucket) -> None: ...

    async def finish_weight_update(self, version: int) -> None: ...

    async def abort_weight_update(self) -> None: ...


class WeightSyncError(RuntimeError):
    """A push or a verification failed; the message names the engine."""


def check_due(version: int, every: int) -> bool:
    """Whether the update to ``version`` is checked when every ``every``-th one is (1: all of them)."""
    if every < 1:
        raise ValueError(f"the weight check interval must be >= 1, got {every}")
    return version % every == 0


@dataclass
class SyncMetrics:
    """One update: wall seconds for all engines, payload bytes (per engine), throughput per engine."""

    version: int
    seconds: float
    bytes: int
    bytes_per_s: float
    buckets: int = 0
    per_engine_seconds: dict[str, float] = field(default_factory=dict)  # engines that took the whole update
    failed: dict[str, str] = field(default_factory=dict)  # engine label -> error
    logprob_diff: dict[str, float] = field(default_factory=dict)  # check mode: engine label -> max |dlogprob|
    # Where the update's time went: begin (pause + open on every server), group (forming the shared
    # transfer group, when it was formed), buckets, finish (label, finalize, resume), check.
    phase_seconds: dict[str, float] = field(default_factory=dict)
    sender_broadcasts: int = 0  # tensor broadcasts rank 0 made for the shared group (one per tensor)
    group_formations: int = 0  # times the shared group was formed in this update (0: reused)

    @property
    def max_abs_logprob_diff(self) -> float | None:
        return max(self.logprob_diff.values()) if self.logprob_diff else None

    def as_dict(self, prefix: str = "weight_sync/") -> dict:
        out = {f"{prefix}seconds": self.seconds, f"{prefix}bytes": float(self.bytes),
               f"{prefix}bytes_per_s": self.bytes_per_s, f"{prefix}buckets": self.buckets,
               f"{prefix}engines_failed": len(self.failed), f"{prefix}sender_broadcasts": self.sender_broadcasts,
               f"{prefix}group_formations": self.group_formations}
        out.update({f"{prefix}{k}_s": v for k, v in self.phase_seconds.items()})
        if "buckets" in self.phase_seconds and "send_wait" in self.phase_seconds:
            # Sending time hidden under the production of the next bucket (the export's gathers).
            out[f"{prefix}overlap_s"] = max(0.0, self.phase_seconds["buckets"] - self.phase_seconds["send_wait"])
        if self.logprob_diff:
            out[f"{prefix}max_abs_logprob_diff"] = self.max_abs_logprob_diff
            out[f"{prefix}logprob_diff_by_engine"] = dict(self.logprob_diff)
        return out


def engine_label(engine: object, index: int) -> str:
    return f"engine {index} ({getattr(engine, 'name', type(engine).__name__)})"


class WeightSync:
    """Versioned, streamed weight updates to a set of rollout engines (see the module docstring)."""

    def __init__(self, engines: Sequence[UpdatableEngine], timeout_s: float, check: bool = False, atol: float = 1e-3,
                 strict: bool = True, labels: Sequence[str] | None = None, check_every: int = 1) -> None:
        if not engines:
            raise ValueError("WeightSync needs at least one rollout engine")
        if not timeout_s > 0:
            raise ValueError(f"WeightSync timeout_s must be > 0, got {timeout_s!r}")
        self.engines = list(engines)
        self.labels = list(labels) if labels is not None else [engine_label(e, i) for i, e in enumerate(self.engines)]
        if len(self.labels) != len(self.engines):
            raise ValueError(f"WeightSync: {len(self.labels)} labels for {len(self.engines)} engines")
        self.timeout_s = float(timeout_s)
        self.check, self.atol, self.strict = check, atol, strict
        check_due(0, check_every)  # refuses an interval < 1
        self.check_every = check_every
        self.group = None  # ServerTransferGroup of the broadcast engines, made at the first update
        self._retry: set = set()  # group members that may still be sent a bucket again in this update
        self._active: list[int] | None = None  # engines in the update in progress
        self._probation: set[int] = set()  # rejoining engines: a failed check leaves them out, not the run
        self._updated: list[int] = []  # engines that took the last finished update (the ones a check scores)
        self._t_check = 0.0
        self._metrics: SyncMetrics | None = None
        self._t0 = 0.0

    # ------------------------------------------------------------------ one update, streamed
    async def begin(self, version: int, only: Iterable[int] | None = None, probation: Iterable[int] = ()) -> None:
        """Start ``version`` on every engine (or the indices in ``only``). An engine in ``probation`` (a
        server rejoining after it was out of service) that fails the weight check is reported in
        ``SyncMetrics.failed`` like any failed engine, instead of stopping the update."""
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"WeightSync version must be an int >= 0, got {version!r}")
        if self._active is not None:
            raise WeightSyncError(f"weight sync v{version} begun while v{self._metrics.version} is in progress")
        self._active = sorted(set(range(len(self.engines)) if only is None else only))
        self._probation = set(probation)
        if not self._active:
            raise WeightSyncError(f"weight sync v{version}: no engine to update")
        self._metrics, self._t0 = SyncMetrics(version, 0.0, 0, 0.0), time.perf_counter()
        self._sent0 = self.group.broadcasts if self.group is not None else 0
        await self._each("begin", lambda e: e.begin_weight_update(version))
        t1 = time.perf_counter()
        self._metrics.phase_seconds["begin"] = t1 - self._t0
        await self._ensure_group()
        self._metrics.phase_seconds["group"] = time.perf_counter() - t1

    # ------------------------------------------------------------------ the shared transfer group
    def _grouped(self) -> list[int]:
        return [i for i in self._active if getattr(self.engines[i], "group_transport", None)]

    async def _ensure_group(self) -> None:
        """Form the shared group over the broadcast engines of this update, unless it already is."""
        grouped = self._grouped()
        if not grouped:
            return
        if self.group is None:
            from megatron_sao.weights.server_group import ServerTransferGroup

            e = self.engines[grouped[0]]
            self.group = ServerTransferGroup(e.cfg.weight_transfer_master_address, e.cfg.weight_transfer_ports,
                                             e.group_transport, self.timeout_s)
            self._sent0 = self.group.broadcasts
        formed = self.group.formations
        self.group.new_update()
        failed = await self.group.ensure([self.engines[i] for i in grouped])
        self._metrics.group_formations += self.group.formations - formed
        self._fail_members(failed, "begin")
        self._retry = {self.engines[i] for i in self._grouped()}

    def _fail_members(self, failed: dict, what: str) -> None:
        index = {id(e): i for i, e in enumerate(self.engines)}
        for member, why in failed.items():
            self._fail(index[id(member)], f"{what} of weight sync v{self._metrics.version}: {why}")

    async def _group_bucket(self, bucket: WeightBucket, grouped: list[int]) -> None:
        if not grouped:
            return
        t0 = time.perf_counter()
        formed = self.group.formations
        failed = await self.group.send_bucket(bucket, self._retry)
        self._metrics.group_formations += self.group.formations - formed
        self._fail_members(failed, "bucket")
        per, dt = self._metrics.per_engine_seconds, time.perf_counter() - t0
        for i in grouped:
            if i in self._active:
                per[self.labels[i]] = per.get(self.labels[i], 0.0) + dt

    async def close(self) -> None:
        """Close the shared transfer group (the engines are closed by their owner)."""
        group, self.group = self.group, None
        if group is not None:
            group.close()

    async def send_bucket(self, bucket: WeightBucket) -> None:
        """Push one bucket to every engine still in the update; returns when all have it (or failed)."""
        if self._active is None:
            raise WeightSyncError("send_bucket outside begin/finish")
        bucket = list(bucket)
        t0 = time.perf_counter()
        self._metrics.bytes += bucket_bytes(bucket)
        self._metrics.buckets += 1
        grouped = self._grouped()
        apart = [i for i in self._active if i not in grouped]
        await asyncio.gather(self._group_bucket(bucket, grouped),
                             *(self._one(i, "bucket", self.engines[i].push_weight_bucket(bucket)) for i in apart))
        phases = self._metrics.phase_seconds
        phases["buckets"] = phases.get("buckets", 0.0) + time.perf_counter() - t0

    async def finish(self, version: int, *, check_tokens: list[int] | None = None, check_prompt_len: int = 1,
                     reference_logprobs: list[float] | None = None, routed_check: bool = False) -> SyncMetrics:
        """Make ``version`` live everywhere, check every engine reports it, verify in check mode.

        ``routed_check`` (routing replay): the reference depends on each engine's routes, so the check
        is the caller's next two steps: ``score_routed`` after this, then ``judge`` with the trainer's
        log-probs computed with those routes."""
        if self._active is None or self._metrics.version != version:
            raise WeightSyncError(f"finish of weight sync v{version} without its begin")
        if self.check and check_due(version, self.check_every) and not routed_check and (
                check_tokens is None or reference_logprobs is None):
            await self.abort()
            raise ValueError(f"WeightSync(check=True, check_every={self.check_every}).finish of v{version} needs "
                             "check_tokens and reference_logprobs")
        t0 = time.perf_counter()
        await self._each("finish", lambda e: e.finish_weight_update(version))
        self._metrics.phase_seconds["finish"] = time.perf_counter() - t0
        for i in list(self._active):
            if self.engines[i].version != version:
                self._fail(i, f"reports version {self.engines[i].version} after the update to {version}")
        m, active = self._metrics, self._active
        self._active = None
        m.seconds = time.perf_counter() - self._t0
        m.per_engine_seconds = {k: v for k, v in m.per_engine_seconds.items() if k not in m.failed}
        m.bytes_per_s = m.bytes / max(m.seconds, 1e-9)
        if self.group is not None:
            m.sender_broadcasts = self.group.broadcasts - self._sent0
        if m.failed and self.strict:
            raise WeightSyncError(f"weight sync v{version} failed: "
                                  + "; ".join(f"{k}: {v}" for k, v in m.failed.items()))
        self._updated = active
        if self.check and check_tokens is not None and reference_logprobs is not None and not routed_check:
            t0 = time.perf_counter()
            diffs = await asyncio.gather(*(self.verify(self.engines[i], check_tokens, reference_logprobs, self.atol,
                                                       prompt_len=check_prompt_len, index=i) for i in active),
                                         return_exceptions=True)  # every server at once
            self._settle_check(m, dict(zip(active, diffs)), time.perf_counter() - t0)
        return m

    # ------------------------------------------------------------------ check mode under routing replay
    async def score_routed(self, check_tokens: list[int], prompt_len: int = 1) -> dict[int, tuple | BaseException]:
        """After ``finish(..., routed_check=True)``: every updated engine's (log-probs of
        ``check_tokens[prompt_len:]``, routes [T, layers, topk] of all of ``check_tokens``), or the error it
        raised, by engine index. The engines are scored at once, each under the timeout."""
        async def one(i: int):
            engine, label = self.engines[i], self.labels[i]
            score = getattr(engine, "score_routed", None)
            if score is None:
                raise TypeError(f"{label} has no score_routed(token_ids, start); routing replay cannot check it")
            return await asyncio.wait_for(score(check_tokens, prompt_len), self.timeout_s)

        self._t_check = time.perf_counter()
        got = await asyncio.gather(*(one(i) for i in self._updated), return_exceptions=True)
        return dict(zip(self._updated, got))

    def judge(self, metrics: SyncMetrics, scored: dict[int, tuple | BaseException],
              references: dict[int, list[float]], prompt_len: int = 1) -> None:
        """Compare each engine's log-probs from ``score_routed`` with ``references[i]``, the trainer's
        log-probs computed with that engine's routes; the outcome as in ``finish``'s own check."""
        diffs: dict[int, float | BaseException] = {}
        for i, got in scored.items():
            if isinstance(got, BaseException):
                diffs[i] = got
                continue
            try:
                diffs[i] = self._compare(engine_label(self.engines[i], i), self.engines[i].version, got[0],
                                         references[i], prompt_len)
            except WeightSyncError as e:
                diffs[i] = e
        self._settle_check(metrics, diffs, time.perf_counter() - self._t_check)

    def _settle_check(self, m: SyncMetrics, diffs: dict[int, float | BaseException], seconds: float) -> None:
        """A failed check stops the update (raises), except for a rejoining engine: that one is failed."""
        for i, got in diffs.items():
            if not isinstance(got, BaseException):
                m.logprob_diff[self.labels[i]] = got
                continue
            if i not in self._probation or not isinstance(got, (WeightSyncError, asyncio.TimeoutError)):
                raise got
            m.failed[self.labels[i]] = f"weight check: {type(got).__name__}: {got}"
            m.per_engine_seconds.pop(self.labels[i], None)
        m.phase_seconds["check"] = seconds

    async def abort(self) -> None:
        """Drop the update in progress on every engine still in it (best effort, under the timeout)."""
        if self._active is None:
            return
        active, self._active = self._active, None

        async def one(i: int) -> None:
            try:
                await asyncio.wait_for(self.engines[i].abort_weight_update(), self.timeout_s)
            except Exception:  # aborting a broken engine may fail too
                pass
        await asyncio.gather(*(one(i) for i in active))

    async def push(self, buckets: Iterable[WeightBucket], version: int, *, check_tokens: list[int] | None = None,
                   check_prompt_len: int = 1, reference_logprobs: list[float] | None = None) -> SyncMetrics:
        """The whole update in one call (buckets pulled one at a time)."""
        await self.begin(version)
        try:
            for bucket in buckets:
                await self.send_bucket(bucket)
        except BaseException:
            await self.abort()
            raise
        return await self.finish(version, check_tokens=check_tokens, check_prompt_len=check_prompt_len,
                                 reference_logprobs=reference_logprobs)

    # ------------------------------------------------------------------ per engine
    async def _each(self, what: str, op) -> None:
        await asyncio.gather(*(self._one(i, what, op(self.engines[i])) for i in list(self._active)))

    async def _one(self, index: int, what: str, call: Awaitable) -> None:
        label, v = self.labels[index], self._metrics.version
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(call, self.timeout_s)
        except asyncio.TimeoutError:
            self._fail(index, f"{what} of weight sync v{v} timed out after {self.timeout_s:.1f}s")
        except Exception as e:  # reported per engine
            self._fail(index, f"{what} of weight sync v{v} failed: {type(e).__name__}: {e}")
        else:
            per = self._metrics.per_engine_seconds
            per[label] = per.get(label, 0.0) + time.perf_counter() - t0

    def _fail(self, index: int, message: str) -> None:
        if index in self._active:
            self._active.remove(index)
        self._metrics.failed[self.labels[index]] = message
        engine = self.engines[index]
        if self._active is not None and hasattr(engine, "abort_weight_update"):
            asyncio.ensure_future(_quietly(engine.abort_weight_update(), self.timeout_s))

    # ------------------------------------------------------------------ check mode
    async def verify(self, engine: UpdatableEngine, token_ids: list[int], reference_logprobs: list[float], atol: float,
                     *, prompt_len: int = 1, index: int = 0) -> float:
        """Max |engine log-prob - reference| over ``token_ids[prompt_len:]`` (T=1); raise if above ``atol``.

        The engine must offer ``score(token_ids, start) -> list[float]`` (HFEngine, VLLMEngine and the
        server client do). ``reference_logprobs`` has one entry per scored token.
        """
        label = engine_label(engine, index)
        score = getattr(engine, "score", None)
        if score is None:
            raise TypeError(f"{label} has no score(token_ids, start) method; it cannot be verified")
        if not 1 <= prompt_len < len(token_ids):
            raise ValueError(f"verify: prompt_len must be in [1, {len(token_ids) - 1}], got {prompt_len}")
        if len(reference_logprobs) != len(token_ids) - prompt_len:
            raise ValueError(
                f"verify: {len(reference_logprobs)} reference log-probs for {len(token_ids) - prompt_len} scored tokens"
            )
        got = await asyncio.wait_for(score(token_ids, prompt_len), self.timeout_s)
        return self._compare(label, engine.version, got, reference_logprobs, prompt_len, atol)

    def _compare(self, label: str, version: int, got: list[float], reference: list[float], prompt_len: int,
                 atol: float | None = None) -> float:
        """Max |got - reference|; WeightSyncError with the worst positions above ``atol`` (default: the sync's)."""
        atol = self.atol if atol is None else atol
        if len(got) != len(reference):
            raise WeightSyncError(f"weight check on {label}: {len(got)} log-probs for {len(reference)} reference ones")
        diffs = [abs(a - b) for a, b in zip(got, reference)]
        worst = max(diffs)
        if not worst <= atol:  # also catches NaN
            top = sorted(range(len(diffs)), key=lambda i: -diffs[i])[:3]
            detail = ", ".join(f"pos {prompt_len + i}: engine {got[i]:.5f} vs ref {reference[i]:.5f}" for i in top)
            raise WeightSyncError(
                f"weight check failed on {label} (version {version}): "
                f"max |dlogprob| {worst:.3g} > atol {atol:g}; {detail}"
            )
        return worst


async def _quietly(call: Awaitable, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(call, timeout_s)
    except Exception:  # cleaning up after a failure
        pass
