"""One streamed update: the trainer's buckets pulled on the calling thread, each sent while the next
is produced.

The export generator runs collectives on every trainer rank when it produces a bucket (the TP/EP
gathers to the sender), so it is pulled here, on the trainer thread; sending a bucket runs on the
rollout side's event loop (``loop.submit``). Bucket k has reached every engine before bucket k+2 is
asked for, so the sender holds at most two buckets and never the model (57 GiB of bf16 for
Qwen3-30B-A3B would not fit beside the trainer state). The engines pause and open the update while
the first bucket is produced. The generator is always iterated to the end, even after a failure, so
the other trainer ranks' collectives stay paired with the sender's (``drain``).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Coroutine, Iterable
from typing import Any, Callable, Protocol

from megatron_sao.weights.buckets import WeightBucket
from megatron_sao.weights.sync import SyncMetrics, WeightSync, check_due


class LoopRunner(Protocol):
    """Runs coroutines on the event loop that owns the engines (the rollout side's episode driver)."""

    def submit(self, coro: Coroutine) -> concurrent.futures.Future: ...

    def call(self, coro: Coroutine, timeout: float | None = None) -> Any: ...


def drain(buckets: Iterable[WeightBucket]) -> None:
    """Produce and drop every bucket: what a rank that sends nothing does, so its collectives pair up."""
    for _ in buckets:
        pass


def stream_update(sync: WeightSync, loop: LoopRunner, buckets: Iterable[WeightBucket], version: int,
                  engines: list[int], *, probation: list[int], wait_s: float,
                  check_tokens: list[int] | None = None, check_prompt_len: int = 1,
                  reference_logprobs: list[float] | None = None,
                  routed_reference: Callable[[dict[int, Any]], dict[int, list[float]]] | None = None) -> SyncMetrics:
    """Stream ``buckets`` to the engines at indices ``engines`` as ``version``; the update's metrics.

    ``probation``: engines rejoining after they were out of service (a failed check fails them, not the
    update). The weight check compares every engine's log-probs of ``check_tokens`` with
    ``reference_logprobs``; under routing replay with ``routed_reference`` instead: the engines return
    their routes of the check tokens with their log-probs, and ``routed_reference({engine: routes})``
    (called here, on the trainer thread: it runs the trainer's forward on every rank) gives each
    engine's reference, computed with its routes. ``wait_s`` bounds each wait for the loop.
    """
    it, begun = iter(buckets), None
    produce_s = wait_total = 0.0  # the overlap: producing bucket k+1 vs waiting for bucket k to arrive
    try:
        begun = loop.submit(sync.begin(version, engines, probation=probation))
        in_flight = None
        while True:
            t0 = time.perf_counter()
            bucket = next(it, None)
            t1 = time.perf_counter()
            produce_s += t1 - t0
            if begun is not None:
                begun.result(wait_s)
                begun = None
            if in_flight is not None:
                in_flight.result(wait_s)  # bucket k reached every engine before k+2 is produced
                wait_total += time.perf_counter() - t1
            if bucket is None:
                break
            in_flight = loop.submit(sync.send_bucket(bucket))
            bucket = None  # the sender holds it until sent, not us
        routed = routed_reference is not None and sync.check and check_due(version, sync.check_every)
        metrics = loop.call(sync.finish(version, check_tokens=check_tokens, check_prompt_len=check_prompt_len,
                                        reference_logprobs=reference_logprobs, routed_check=routed), timeout=wait_s)
        if routed:
            scored = loop.call(sync.score_routed(check_tokens, check_prompt_len), timeout=wait_s)
            routes = {i: got[1] for i, got in scored.items() if not isinstance(got, BaseException)}
            sync.judge(metrics, scored, routed_reference(routes) if routes else {}, check_prompt_len)
    except BaseException:
        drain(it)
        try:
            if begun is not None:  # the update is opened before it is aborted
                concurrent.futures.wait([begun], wait_s)
            loop.call(sync.abort(), timeout=wait_s)
        except Exception:  # already failing
            pass
        raise
    metrics.phase_seconds["produce"] = produce_s  # on the trainer thread, while the previous bucket was sent
    metrics.phase_seconds["send_wait"] = wait_total  # the trainer waiting for a bucket still on the wire
    return metrics
