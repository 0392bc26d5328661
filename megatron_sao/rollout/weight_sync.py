"""Push the trainer's HF-named weight export to every rollout engine, with timeouts and a check mode.

The trainer (Megatron) exports its weights gathered across TP/EP/PP as an iterator of buckets of
``(hf_name, tensor)``. ``WeightSync.push`` materializes that iterator once (the buckets hold references
to the exported tensors, not copies), then updates all engines concurrently, each under
``asyncio.wait_for(timeout_s)``: a hung engine becomes a ``WeightSyncError`` naming it instead of a
silent stall (pitfall 2 in NOTES). A timed-out engine may still be applying the update in its own
thread or process; treat it as broken (health-check or restart it) rather than retrying blindly.

Check mode (pitfall 3, silent MoE refit corruption): after a push, ``verify`` compares an engine's
log-probs of fixed tokens with reference log-probs the trainer computed for the same tokens under the
same weights, and raises with the worst positions if they differ by more than ``atol``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from megatron_sao.rollout.engine import RolloutEngine, WeightBucket


class WeightSyncError(RuntimeError):
    """A push or a verification failed; the message names the engine."""


@dataclass
class SyncMetrics:
    """One push: wall seconds for all engines, payload bytes (per engine), throughput per engine."""

    version: int
    seconds: float
    bytes: int
    bytes_per_s: float
    per_engine_seconds: list[float] = field(default_factory=list)
    max_abs_logprob_diff: float | None = None  # set when check mode ran

    def as_dict(self, prefix: str = "weight_sync/") -> dict[str, float]:
        out = {f"{prefix}seconds": self.seconds, f"{prefix}bytes": float(self.bytes), f"{prefix}bytes_per_s": self.bytes_per_s}
        if self.max_abs_logprob_diff is not None:
            out[f"{prefix}max_abs_logprob_diff"] = self.max_abs_logprob_diff
        return out


def engine_label(engine: object, index: int) -> str:
    return f"engine {index} ({getattr(engine, 'name', type(engine).__name__)})"


class WeightSync:
    """Versioned weight pushes to a fixed set of rollout engines.

    ``check=True`` makes ``push`` accept ``check_tokens`` / ``check_prompt_len`` / ``reference_logprobs``
    and verify every engine after the push (see ``verify``).
    """

    def __init__(self, engines: Sequence[RolloutEngine], timeout_s: float, check: bool = False, atol: float = 1e-3) -> None:
        if not engines:
            raise ValueError("WeightSync needs at least one rollout engine")
        if not timeout_s > 0:
            raise ValueError(f"WeightSync timeout_s must be > 0, got {timeout_s!r}")
        self.engines = list(engines)
        self.timeout_s = float(timeout_s)
        self.check = check
        self.atol = atol

    async def push(
        self,
        buckets: Iterable[WeightBucket],
        version: int,
        *,
        check_tokens: list[int] | None = None,
        check_prompt_len: int = 1,
        reference_logprobs: list[float] | None = None,
    ) -> SyncMetrics:
        """Send ``buckets`` as ``version`` to every engine concurrently; raise WeightSyncError on any failure."""
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"WeightSync.push version must be an int >= 0, got {version!r}")
        if self.check and (check_tokens is None or reference_logprobs is None):
            raise ValueError("WeightSync(check=True).push needs check_tokens and reference_logprobs")
        materialized = [list(b) for b in buckets]
        nbytes = sum(t.numel() * t.element_size() for b in materialized for _, t in b)
        t0 = time.perf_counter()
        per_engine = await asyncio.gather(
            *(self._push_one(i, e, materialized, version) for i, e in enumerate(self.engines)), return_exceptions=True
        )
        seconds = time.perf_counter() - t0
        errors = [r for r in per_engine if isinstance(r, BaseException)]
        if errors:
            raise WeightSyncError("; ".join(str(e) for e in errors)) from errors[0]
        metrics = SyncMetrics(version, seconds, nbytes, nbytes / max(seconds, 1e-9), [float(s) for s in per_engine])
        if self.check:
            diffs = [
                await self.verify(e, check_tokens, reference_logprobs, self.atol, prompt_len=check_prompt_len, index=i)
                for i, e in enumerate(self.engines)
            ]
            metrics.max_abs_logprob_diff = max(diffs)
        return metrics

    async def _push_one(self, index: int, engine: RolloutEngine, buckets: list[WeightBucket], version: int) -> float:
        label = engine_label(engine, index)
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(engine.update_weights(buckets, version), self.timeout_s)
        except asyncio.TimeoutError as e:
            raise WeightSyncError(f"weight sync v{version} to {label} timed out after {self.timeout_s:.1f}s") from e
        except Exception as e:
            raise WeightSyncError(f"weight sync v{version} to {label} failed: {type(e).__name__}: {e}") from e
        if engine.version != version:
            raise WeightSyncError(f"{label} reports version {engine.version} after a push of version {version}")
        return time.perf_counter() - t0

    async def verify(
        self,
        engine: RolloutEngine,
        token_ids: list[int],
        reference_logprobs: list[float],
        atol: float,
        *,
        prompt_len: int = 1,
        index: int = 0,
    ) -> float:
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
        diffs = [abs(a - b) for a, b in zip(got, reference_logprobs)]
        worst = max(diffs)
        if not worst <= atol:  # also catches NaN
            top = sorted(range(len(diffs)), key=lambda i: -diffs[i])[:3]
            detail = ", ".join(f"pos {prompt_len + i}: engine {got[i]:.5f} vs ref {reference_logprobs[i]:.5f}" for i in top)
            raise WeightSyncError(
                f"weight check failed on {label} (version {engine.version}): max |dlogprob| {worst:.3g} > atol {atol:g}; {detail}"
            )
        return worst
