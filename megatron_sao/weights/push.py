"""After each actor step: the actor's weights streamed to every rollout server as the new version (the
trainer's one entry into weight movement: ``WeightPush.push``).

All ranks call ``push``: the export gathers the TP/EP/PP shards with collectives, bucket by bucket;
rank 0 hands the bucket generator to the rollout side (``RolloutSide.push_weights``), which sends each
bucket while the next one is produced, so rank 0 never holds more than two buckets (57 GiB of bf16
for Qwen3-30B-A3B would not fit beside the trainer state); the other ranks drain the generator so
their collectives pair with rank 0's. A failure on rank 0 is broadcast, so every rank stops at the
same point instead of waiting in the next collective.

The weight check (``rollout.weight_sync_check``) needs the actor's log-probs of fixed tokens, a
forward on every rank. Without routing replay it runs before the push. With it, the reference
depends on each server's routes of those tokens, known only after the update: rank 0 broadcasts
``("check", routes)`` from inside the push and every rank runs the forward with them, then rank 0
broadcasts ``("done", error)``; the other ranks answer each message until "done".

The colocated placement loads weights in-process on every rank instead (``trainer/colocated.py``,
``rollout/colocate/cycle.py``), and replay runs have no engine: both use ``NoWeightPush``.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from megatron_sao.errors import TrainingStopped
from megatron_sao.weights.check import check_reference, check_tokens
from megatron_sao.weights.stream import drain
from megatron_sao.weights.sync import check_due

logger = logging.getLogger(__name__)


class WeightPush:
    """``rollout``: rank 0's ``RolloutSide`` (None on the other ranks); ``collectives``: ``GatedCollectives``."""

    def __init__(self, actor, rollout, collectives, *, bucket_bytes: int, policy_lag: int = 0,
                 check: bool = False, check_every: int = 1) -> None:
        self.actor, self.rollout, self.collectives = actor, rollout, collectives
        self.bucket_bytes, self.policy_lag, self.check = bucket_bytes, policy_lag, check
        check_due(0, check_every)  # refuses an interval < 1
        self.check_every = check_every  # rollout.weight_sync_check_every: every rank decides alike, by version
        self._lagged: deque = deque()  # trainer.policy_lag: (version, weights) not yet pushed

    def push(self, version: int, step: int) -> float:
        """Stream the actor's weights as ``version`` (after trainer.policy_lag steps); the seconds it took."""
        t0 = time.monotonic()
        buckets = self.actor.export_hf_weights(self.bucket_bytes)
        if self.policy_lag:
            lagged = self._lagged_snapshot(buckets, version)
            if lagged is None:
                return time.monotonic() - t0
            version, buckets = lagged
        self._send(buckets, version, step)
        return time.monotonic() - t0

    def push_resumed(self, version: int, step: int) -> None:
        """After a resume: the servers start from the base model, so they get the resumed weights now."""
        self._send(self.actor.export_hf_weights(self.bucket_bytes), version, step)

    def _lagged_snapshot(self, buckets, version: int):
        """trainer.policy_lag (a CPU staleness stress test): keep an explicit CPU copy of this version's
        weights and return the (version, buckets) of `policy_lag` steps ago, or None while there is
        none. By design this holds policy_lag + 1 full copies of the model in host memory; the config
        refuses it for bf16/fp16 models and cluster placements (config validation)."""
        snapshot = [[(n, t.detach().to("cpu", copy=True)) for n, t in b] for b in buckets]
        self._lagged.append((version, snapshot))
        if len(self._lagged) <= self.policy_lag:
            return None
        version, snapshot = self._lagged.popleft()
        return version, iter(snapshot)

    def _send(self, buckets, version: int, step: int) -> None:
        check = {}
        if self.check and check_due(version, self.check_every):
            tokens = check_tokens(self.actor.spec.vocab_size)
            if self.actor.replay_routes:  # the reference needs the servers' routes: after the push
                check = {"check_tokens": tokens, "check_prompt_len": 1, "routed_reference": self._routed_reference}
            else:
                check = {"check_tokens": tokens, "check_prompt_len": 1,
                         "reference_logprobs": check_reference(self.actor, tokens)[0]}
        error = None
        if self.rollout is not None:
            try:
                m = self.rollout.push_weights(buckets, version, **check)
                logger.info("weights v%d -> %d server(s): %.2fs, %d buckets, %.1f MB (%s)", version,
                            len(m.per_engine_seconds), m.seconds, m.buckets, m.bytes / 2**20,
                            ", ".join(f"{k} {v:.3f}s" for k, v in m.phase_seconds.items()))
            except Exception as e:  # every rank must learn it, or they wait forever
                error = f"{type(e).__name__}: {e}"
            self.collectives.broadcast(("done", error), "the end of the weight push")
        else:
            drain(buckets)  # the export's collectives pair with rank 0's
            while True:  # rank 0 may first ask for the check's forward with the servers' routes
                what, payload = self.collectives.broadcast(None, "the end of the weight push")
                if what == "done":
                    error = payload
                    break
                check_reference(self.actor, check_tokens(self.actor.spec.vocab_size), payload)
        if error is not None:
            # No checkpoint here: the actor has stepped but no server holds its weights; the last
            # checkpoint (and the post-resume push) is the consistent state to go back to.
            raise TrainingStopped(f"weight sync v{version} failed at step {step}: {error}")

    def _routed_reference(self, routes: dict[int, torch.Tensor]) -> dict[int, list[float]]:
        """Rank 0, inside the push: every server's reference log-probs, the actor's forward with that
        server's routes of the check tokens replayed (the other ranks join it from ``_send``)."""
        servers = sorted(routes)
        per_server = [routes[i] for i in servers]
        self.collectives.broadcast(("check", per_server), "the weight check's forward")
        return dict(zip(servers, check_reference(self.actor, check_tokens(self.actor.spec.vocab_size), per_server)))


class NoWeightPush:
    """Replay runs (no rollout engine) and the colocated placement (every rank loads after the step)."""

    def push(self, version: int, step: int) -> float:
        return 0.0

    def push_resumed(self, version: int, step: int) -> None:
        pass
