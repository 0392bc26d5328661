"""The colocated placement on one rank: its engine shard, the rollout phases, and the memory dance.

Each trainer rank hosts one shard of one vLLM engine (``layout.py``, ``vllm_shard.py``). Generation
and training take turns on the same GPUs; one trainer step is

    rollout phase     serve(until)       every rank serves its engine until rank 0 has a batch
    sleep             engine.sleep(2)    KV cache and weights released (GPU: discarded)
    trainer onload    actor + critic     params, grads, optimizer state back on the device
    train             (the trainer)      critic and actor steps
    trainer offload   critic: all; actor: grads + optimizer (the actor's params feed the update)
    wake weights      engine.wake(["weights"])
    load weights      the actor's every-rank export, bucket by bucket into the shard (in-process:
                      no NCCL between the trainer and vLLM, which share the GPU and the process)
    params offload    actor params
    wake KV           engine.wake(["kv_cache"])

so no phase holds the trainer's optimizer state next to the engine's weights, or the engine's KV
cache next to any trainer state. The weight check (``rollout.weight_sync_check``) compares each
engine's log-probs of fixed tokens with the actor's forward, computed between load and params offload;
under routing replay that forward needs the engine's routes of those tokens, which it gives only awake,
so after wake KV the engine sleeps at level 1 around the forward and wakes again (``_routed_check``).
The peak is the load phase: the actor's params, the engine's
weights and two buckets. Each call is timed and its memory recorded (``probe.py``): rank 0's figures
go to metrics as ``colocate/<phase>_s`` / ``..._device_used_bytes`` (``..._rss_bytes`` on a CPU
build), and every rank's records to ``<run>/colocate_trace.jsonl``. At start the trainer is
offloaded before the engine is built, then the same refresh (wake, load, wake) gives the engine the
actor's weights, so a resumed or fine-tuned actor needs no other path.

Checkpoints need the trainer state on the device while the engine is awake: ``trainer_resident``
sleeps the engine at level 1 (weights kept on the host, KV cache released), onloads, and reverses it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence

import torch.distributed as dist

from megatron_sao.rollout.colocate.hub import LockstepEngine, RequestHub
from megatron_sao.rollout.colocate.layout import EngineLayout
from megatron_sao.rollout.colocate.lockstep import PhaseStats, RoundLeader, serve_phase
from megatron_sao.rollout.colocate.probe import PhaseProbe, phase_metrics
from megatron_sao.weights.check import check_reference

logger = logging.getLogger(__name__)

ALL = ("params", "grads", "optimizer")


class WeightCheckFailed(RuntimeError):
    """An engine's log-probs after the in-process load differ from the actor's."""


class ColocatedRollout:
    """One rank's colocated engine and the phases around training (module docstring). Collective:
    every method is called by every rank, in the same order."""

    def __init__(self, layout: EngineLayout, make_shard: Callable[[], object], *, steps_per_round: int = 16,
                 heartbeat_s: float = 10.0, seed: int = 0) -> None:
        self.layout, self.make_shard, self.shard = layout, make_shard, None
        self.steps_per_round, self.heartbeat_s = steps_per_round, heartbeat_s
        # Control traffic of the lockstep rounds: pickled lists on a host (gloo) group of the world.
        self.group = dist.new_group(backend="gloo")
        self.leader_rank = layout.rank == 0
        self.hub = RequestHub(layout.engines, seed=seed) if self.leader_rank else None
        self.engines = ([LockstepEngine(self.hub, e, f"colocated-engine-{e}") for e in range(layout.engines)]
                        if self.leader_rank else [])
        self.version = 0
        self.probe = PhaseProbe(layout.rank)
        self.last_phase: PhaseStats | None = None

    # ------------------------------------------------------------------ observation
    def _engine_state(self) -> dict:
        if self.shard is None:
            return {}
        return {"engine": {"sleeping_tags": self.shard.sleeping_tags, "kv_bytes": self.shard.kv_bytes(),
                           "version": self.shard.version}}

    def _observe(self, models: Sequence) -> Callable[[], dict]:
        def observe() -> dict:
            return {**self._engine_state(),
                    "trainer_device_bytes": {m.role: sum(m.device_bytes().values()) for m in models}}
        return observe

    def _call(self, phase: str, call: str, fn, models: Sequence = ()):
        return self.probe.run(call, fn, self._observe(models), phase=phase)

    def _offload(self, m, parts: Sequence[str], models: Sequence, phase: str = "trainer_offload") -> None:
        todo = [p for p in parts if m.resident(p)]
        if todo:
            self._call(phase, f"{m.role}.offload({todo})", lambda: m.offload(todo).total, models)

    def _onload(self, m, parts: Sequence[str], models: Sequence) -> None:
        todo = [p for p in parts if not m.resident(p)]
        if todo:
            self._call("trainer_onload", f"{m.role}.onload({todo})", lambda: m.onload(todo).total, models)

    # ------------------------------------------------------------------ start
    def start(self, actor, models: Sequence, *, bucket_bytes: int, check_tokens: list[int] | None = None,
              atol: float = 1e-3) -> dict:
        """Trainer offloaded, engine built (weights + KV cache on a free device), put to sleep, then
        refreshed with the actor's weights: the engine starts from the actor, whatever it was loaded from."""
        for m in models:
            self._offload(m, ALL, ())
        self.shard = self.probe.run("engine build (vllm.LLM, external_launcher)", self.make_shard, phase="build")
        # What vLLM built, next to the layout this rank expects (the colocated tests compare them).
        self.probe.records[-1].update(engine_index=self.layout.engine,
                                      layout_ranks=self.layout.ranks_of(self.layout.engine),
                                      vllm_tp_group=self.shard.tp_group_ranks())
        self._call("sleep", "engine.sleep(level=2)", lambda: self.shard.sleep(2), models)
        return self.refresh(actor, models, version=0, bucket_bytes=bucket_bytes, check_tokens=check_tokens,
                            atol=atol)

    # ------------------------------------------------------------------ rollout phase
    def serve(self, until: Callable[[], bool] | None, *, evaluation: bool = False) -> PhaseStats | None:
        """Every rank serves its engine until rank 0's ``until()`` is true (lockstep.py). An evaluation
        phase (episodes that train nothing; training episodes go on meanwhile) is recorded apart."""
        t0 = time.monotonic()
        leader = None
        if self.leader_rank:
            leader = RoundLeader(self.hub, self.layout, until, self.version, steps_per_round=self.steps_per_round,
                                 heartbeat_s=self.heartbeat_s)
        try:
            stats = serve_phase(self.shard, self.layout, self.group, leader)
        except BaseException as e:
            if self.hub is not None:
                self.hub.fail_all(e)
            raise
        self.probe.mark(f"{'evaluation' if evaluation else 'rollout'} phase (lockstep rounds)", time.monotonic() - t0,
                        phase="evaluation" if evaluation else "rollout", **({"rounds": stats.rounds} if stats else {}))
        if not evaluation:
            self.last_phase = stats
        return stats

    # ------------------------------------------------------------------ around the train step
    def before_train(self, models: Sequence) -> None:
        """Engine to sleep (level 2: its weights are replaced after the step), then the trainer back."""
        self._call("sleep", "engine.sleep(level=2)", lambda: self.shard.sleep(2), models)
        for m in models:
            self._onload(m, ALL, models)

    def mark_train(self, seconds: float, models: Sequence) -> None:
        self.probe.mark("train (critic + actor steps)", seconds, self._observe(models), phase="train")

    def refresh(self, actor, models: Sequence, *, version: int, bucket_bytes: int,
                check_tokens: list[int] | None = None, atol: float = 1e-3) -> dict:
        """Trainer out, the actor's weights into the engine, KV cache back (the order of the module docstring)."""
        for m in models:
            self._offload(m, ("grads", "optimizer") if m is actor else ALL, models)
        self._onload(actor, ("params",), models)
        self._call("wake_weights", "engine.wake(['weights'])", lambda: self.shard.wake(["weights"]), models)
        self._call("load_weights", "engine.load_weights(actor.export_hf_weights_every_rank)",
                   lambda: self._load(actor, version, bucket_bytes), models)
        reference = None
        routed = check_tokens is not None and actor.replay_routes  # the reference needs the engines' routes
        if check_tokens is not None and not routed:
            reference = self._call("weight_check", "actor.logprobs(check tokens)",
                                   lambda: check_reference(actor, check_tokens)[0], models)
        self._offload(actor, ("params",), models, phase="params_offload")
        self._call("wake_kv", "engine.wake(['kv_cache'])", lambda: self.shard.wake(["kv_cache"]), models)
        self.version = version
        for e in self.engines:
            e.version = version
        out = dict(self.shard.last_update)
        if routed:
            out["weight_check_max_abs_diff"] = self._routed_check(actor, check_tokens, atol, models)
        elif reference is not None:
            out["weight_check_max_abs_diff"] = self._check(self.shard.score(check_tokens, 1), reference, atol)
        return out

    def _load(self, actor, version: int, bucket_bytes: int) -> dict:
        self.shard.begin_update()
        n_bytes = buckets = 0
        for bucket in actor.export_hf_weights_every_rank(bucket_bytes):
            self.shard.load_bucket(bucket)
            n_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            buckets += 1
            del bucket
        return {**self.shard.finish_update(version), "buckets": buckets, "bytes": n_bytes}

    def _routed_check(self, actor, tokens: list[int], atol: float, models: Sequence) -> float:
        """The weight check under routing replay: each engine's log-probs of ``tokens`` against the actor's
        forward with that engine's routes replayed. An engine gives its routes only awake (with its KV
        cache), and its KV cache never shares the device with trainer state: for the forward it sleeps at
        level 1 (weights kept on the host, as for a checkpoint) while the actor's params are back."""
        got, routes = self.shard.score_routed(tokens, 1)
        everyone = [None] * self.layout.world
        dist.all_gather_object(everyone, (self.layout.engine, routes), group=self.group)
        by_engine = dict(everyone)  # the ranks of one engine hold the same routes (lockstep)
        engines = sorted(by_engine)
        self._call("sleep", "engine.sleep(level=1) for the weight check", lambda: self.shard.sleep(1), models)
        self._onload(actor, ("params",), models)
        reference = self._call("weight_check", "actor.logprobs(check tokens, each engine's routes replayed)",
                               lambda: check_reference(actor, tokens, [by_engine[e] for e in engines]), models)
        self._offload(actor, ("params",), models, phase="params_offload")
        self._call("wake_weights", "engine.wake(['weights'])", lambda: self.shard.wake(["weights"]), models)
        self._call("wake_kv", "engine.wake(['kv_cache'])", lambda: self.shard.wake(["kv_cache"]), models)
        return self._check(got, reference[engines.index(self.layout.engine)], atol)

    def _check(self, got: list[float], reference: list[float], atol: float) -> float:
        """This rank's engine log-probs against the actor's; every rank raises on a mismatch anywhere."""
        mine = max(abs(a - b) for a, b in zip(got, reference))
        everyone = [None] * self.layout.world
        dist.all_gather_object(everyone, mine, group=self.group)
        worst = max(everyone)
        if worst > atol:
            bad = {r: d for r, d in enumerate(everyone) if d > atol}
            raise WeightCheckFailed(f"colocated weight check v{self.version}: engine log-probs differ from the "
                                    f"actor's by up to {worst:.3g} (atol {atol:g}) on ranks {bad}")
        return worst

    # ------------------------------------------------------------------ checkpoints
    @contextlib.contextmanager
    def trainer_resident(self, models: Sequence):
        """The trainer state on the device, the engine asleep at level 1 (weights kept on the host)."""
        self._call("sleep", "engine.sleep(level=1) for a checkpoint", lambda: self.shard.sleep(1), models)
        for m in models:
            self._onload(m, ALL, models)
        try:
            yield
        finally:
            for m in models:
                self._offload(m, ALL, models)
            self._call("wake_weights", "engine.wake(['weights'])", lambda: self.shard.wake(["weights"]), models)
            self._call("wake_kv", "engine.wake(['kv_cache'])", lambda: self.shard.wake(["kv_cache"]), models)

    # ------------------------------------------------------------------ records
    def take_records(self, step: int) -> tuple[dict, list[dict] | None]:
        """(rank 0's per-phase metrics, every rank's records on rank 0) since the last call; collective."""
        mine = self.probe.take()
        for r in mine:
            r["step"] = step
        everyone = [None] * self.layout.world if self.leader_rank else None
        dist.gather_object(mine, everyone, dst=0, group=self.group)
        if not self.leader_rank:
            return {}, None
        metrics = phase_metrics(mine)
        if self.last_phase is not None:
            metrics.update(self.last_phase.as_metrics())
        return metrics, [r for per_rank in everyone for r in per_rank]

    def close(self) -> None:
        if self.hub is not None:
            self.hub.fail_all(RuntimeError("the run is closing"))
        if self.shard is not None:
            self.shard.close()
