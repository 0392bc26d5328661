"""Rank 0's side of the colocated engines: generate requests from the episode driver, waiting for a round.

The episode driver (``rollout/episode_driver.py``) runs every agent loop on rank 0, as it does for
disaggregated servers, and sees one ``LockstepEngine`` per colocated engine through the usual
``ServerPool`` (placement, per-engine cap, metrics). A generate call does not reach vLLM directly:
it waits here until the main thread's next lockstep round (``lockstep.py``) hands it to the ranks of
its engine, and its future is resolved when a round reports it finished. Between rollout phases
(while the GPUs train) requests simply wait, so an episode in flight resumes after the pause.

Every request gets its seed here, on rank 0, if the agent loop did not give one: all ranks of an
engine must sample with the same seed (``vllm_shard.py``).
"""

from __future__ import annotations

import asyncio
import collections
import random
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from megatron_sao.rollout.engines.protocol import GenerationResult, SamplingParams
from megatron_sao.weights.buckets import WeightBucket

if TYPE_CHECKING:
    import torch

Wire = tuple[str, list[int], dict, int]  # request id, prompt ids, SamplingParams fields, seed


@dataclass(eq=False)
class _Waiting:
    rid: str
    engine: int
    wire: Wire
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class RequestHub:
    """Thread-safe queue of generate requests per engine, and their futures (module docstring)."""

    def __init__(self, engines: int, seed: int = 0) -> None:
        self.engines = engines
        self._cond = threading.Condition()
        self._new: list[collections.deque[_Waiting]] = [collections.deque() for _ in range(engines)]
        self._sent: dict[str, _Waiting] = {}
        self._rng = random.Random(seed)
        self._count = 0
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ the driver's thread
    def submit(self, engine: int, prompt_ids: list[int], sampling: SamplingParams) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cond:
            if self.error is not None:
                raise RuntimeError(f"colocated engines stopped: {self.error!r}")
            self._count += 1
            rid = f"r{self._count}"
            seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(63)
            wire = (rid, list(prompt_ids), asdict(sampling), seed)
            self._new[engine].append(_Waiting(rid, engine, wire, fut, loop))
            self._cond.notify_all()
        return fut

    # ------------------------------------------------------------------ the main thread (lockstep leader)
    def waiting(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._new)

    def wait_for_requests(self, timeout: float) -> bool:
        with self._cond:
            if not any(self._new):
                self._cond.wait(timeout)
            return any(self._new)

    def take_new(self, room: list[int] | None = None) -> dict[int, list[Wire]]:
        """Move up to ``room[e]`` waiting requests of each engine ``e`` to "sent"; return them by engine."""
        out: dict[int, list[Wire]] = {}
        with self._cond:
            for e, q in enumerate(self._new):
                n = len(q) if room is None else min(len(q), room[e])
                for _ in range(n):
                    w = q.popleft()
                    if w.future.cancelled():  # its episode was cancelled while it waited
                        continue
                    self._sent[w.rid] = w
                    out.setdefault(e, []).append(w.wire)
        return out

    def finish(self, rid: str, token_ids: list[int], logprobs: list[float], reason: str, version: int,
               routes: torch.Tensor | None = None) -> None:
        with self._cond:
            w = self._sent.pop(rid, None)
        if w is None:
            return
        result = GenerationResult(token_ids, logprobs, [version] * len(token_ids), reason, routes)
        _resolve(w, result=result)

    def fail(self, rid: str, error: str) -> None:
        with self._cond:
            w = self._sent.pop(rid, None)
        if w is not None:
            _resolve(w, exc=RuntimeError(error))

    def fail_all(self, exc: BaseException) -> None:
        """Stop: fail every waiting and sent request (the phase broke, or the run is closing)."""
        with self._cond:
            self.error = self.error or exc
            pending = [w for q in self._new for w in q] + list(self._sent.values())
            for q in self._new:
                q.clear()
            self._sent.clear()
            self._cond.notify_all()
        for w in pending:
            _resolve(w, exc=RuntimeError(f"colocated engines stopped: {exc!r}"))


def _resolve(w: _Waiting, result=None, exc: BaseException | None = None) -> None:
    def _set() -> None:
        if w.future.done():
            return
        if exc is not None:
            w.future.set_exception(exc)
        else:
            w.future.set_result(result)
    try:
        w.loop.call_soon_threadsafe(_set)
    except RuntimeError:  # the driver's loop is closed: nobody waits any more
        pass


class LockstepEngine:
    """The ``RolloutEngine`` the episode driver sees for colocated engine ``index`` (rank 0 only).

    Weights never go through it: every rank loads them into its own shard
    (``ColocatedRollout.refresh``), which then sets ``version`` here.
    """

    def __init__(self, hub: RequestHub, index: int, label: str) -> None:
        self.hub, self.index, self.name = hub, index, label
        self.version = 0

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationResult:
        if not prompt_ids:
            raise ValueError(f"{self.name}: generate got an empty prompt")
        return await self.hub.submit(self.index, prompt_ids, sampling)

    async def health(self) -> bool:
        return self.hub.error is None

    async def pause(self) -> None:  # generation pauses between rollout phases anyway
        return None

    async def resume(self) -> None:
        return None

    async def close(self) -> None:
        self.hub.fail_all(RuntimeError("closed"))

    def _in_process_only(self, *_a, **_k):
        raise RuntimeError(f"{self.name}: colocated engines load weights in-process on every rank "
                           "(ColocatedRollout.refresh), not through the rollout side's weight sync")

    async def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        self._in_process_only()

    async def begin_weight_update(self, version: int) -> None:
        self._in_process_only()

    async def push_weight_bucket(self, bucket: WeightBucket) -> None:
        self._in_process_only()

    async def finish_weight_update(self, version: int) -> None:
        self._in_process_only()

    async def abort_weight_update(self) -> None:
        return None
