"""Ranks 1..N wait for rank 0 on the rendezvous store, never inside a long collective.

Rank 0 alone waits for a batch (up to `rollout.timeout_s`, 1800 s in the recipes), evaluates,
pushes weights to the rollout engines and starts them; the other ranks meanwhile have nothing to do
but wait for its next collective. Waiting *inside* that collective trips the NCCL watchdog after
the process-group timeout (600 s) and kills the job. So every collective that follows a rank-0-only
phase is preceded by `Rank0Gate.arrive()`: rank 0 bumps a counter in the c10d store when it gets
there; the others poll the counter (no NCCL work is pending while they do) and enter the collective
only once rank 0 has, so the collective itself is short.

`init_parallel` starts one gate per process group (`start`), `shared()` returns it; every rank
must pass the same gates in the same order, which holds because each gate precedes a collective.
A dead rank 0 must not leave the others polling forever: from `start` on, rank 0 bumps a
heartbeat counter every `heartbeat_s` from a daemon thread, and a waiting rank that sees it stand
still for `stale_s` raises `Rank0Lost`. (Under torchrun the store outlives rank 0; under srun it
dies with it, and the poll raises at once.) A rank 0 that is alive but stuck is bounded by its own
timeouts: the batch wait and every engine call have one.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

_PREFIX = "sao/rank0_gate/"
_shared: "Rank0Gate | None" = None
_generation = 0  # gates started in this process: a new process group on the same store gets fresh keys


class Rank0Lost(RuntimeError):
    """Rank 0 stopped answering while this rank waited for it."""


def default_store():
    """The c10d store of the default process group (torchrun's / the env:// rendezvous store)."""
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        raise RuntimeError("Rank0Gate needs an initialised default process group (init_parallel)")
    get = getattr(c10d, "_get_default_store", None)
    if get is None:
        raise RuntimeError("this torch has no distributed_c10d._get_default_store(); Rank0Gate cannot find the store")
    return get()


class Rank0Gate:
    def __init__(self, store, rank: int, world_size: int, *, poll_s: float = 0.5, heartbeat_s: float = 5.0,
                 stale_s: float = 120.0, prefix: str = _PREFIX) -> None:
        if not (0 < poll_s and 0 < heartbeat_s < stale_s):
            raise ValueError(f"Rank0Gate needs 0 < poll_s and 0 < heartbeat_s < stale_s, "
                             f"got {poll_s}, {heartbeat_s}, {stale_s}")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.poll_s, self.heartbeat_s, self.stale_s = poll_s, heartbeat_s, stale_s
        self.arrivals = 0
        self.prefix = prefix
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def arrive(self, what: str) -> float:
        """Every rank calls this before the same collective; returns the seconds this rank waited.

        `what` names the collective for the error message when rank 0 is lost.
        """
        self.arrivals += 1
        if self.world_size == 1:
            return 0.0
        if self.rank == 0:
            self.start_heartbeat()
            self.store.add(self.prefix + "arrivals", 1)
            return 0.0
        return self._wait(what)

    def _wait(self, what: str) -> float:
        t0 = last_change = time.monotonic()
        beat = self.store.add(self.prefix + "heartbeat", 0)
        delay = min(0.01, self.poll_s)
        while self.store.add(self.prefix + "arrivals", 0) < self.arrivals:
            now = time.monotonic()
            b = self.store.add(self.prefix + "heartbeat", 0)
            if b != beat:
                beat, last_change = b, now
            elif now - last_change > self.stale_s:
                raise Rank0Lost(f"rank {self.rank}: rank 0 sent no heartbeat for {self.stale_s:g}s while this rank "
                                f"waited {now - t0:.0f}s for it to reach {what}")
            time.sleep(delay)
            delay = min(delay * 2, self.poll_s)  # quick when rank 0 is close behind, cheap when it is not
        return time.monotonic() - t0

    def start_heartbeat(self) -> None:
        """Rank 0: prove liveness from now on (a no-op on other ranks or when already beating)."""
        if self._beat is not None or self.rank != 0 or self.world_size == 1:
            return
        self.store.add(self.prefix + "heartbeat", 1)

        def beat() -> None:
            while not self._stop.wait(self.heartbeat_s):
                try:
                    self.store.add(self.prefix + "heartbeat", 1)
                except Exception:  # the store is gone (shutdown); the others notice
                    return

        self._beat = threading.Thread(target=beat, name="sao-rank0-heartbeat", daemon=True)
        self._beat.start()

    def close(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=self.heartbeat_s + 1)
            self._beat = None


def start(rank: int, world_size: int, **kw) -> Rank0Gate:
    """The gate of the process group just created (init_parallel); rank 0 starts beating at once,
    so a rank that reaches its first gate while rank 0 still loads the model sees it alive."""
    global _shared, _generation
    if _shared is not None:
        return _shared  # Megatron state re-initialised over the same process group
    _generation += 1
    _shared = Rank0Gate(default_store() if world_size > 1 else None, rank, world_size,
                        prefix=f"{_PREFIX}{_generation}/", **kw)
    _shared.start_heartbeat()
    return _shared


def shared() -> Rank0Gate:
    if _shared is None:
        raise RuntimeError("no Rank0Gate: init_parallel() starts it")
    return _shared


def stop() -> None:
    """With the process group (destroy_parallel): stop the heartbeat, forget the gate."""
    global _shared
    if _shared is not None:
        _shared.close()
        _shared = None
