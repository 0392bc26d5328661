"""One assistant turn on a rollout engine, shared by the agent loop and the agent endpoint.

``generate_turn`` samples one turn (an aborted request, under ``inflight_policy: abort``, is generated
again from the same prefix, up to ``max_abort_retries``), ``add_turn_routes`` stitches its MoE routes into
the trajectory (routing replay), ``turn_seed`` gives each (prompt, turn) its own seed when the config fixes
one. ``AgentLoopConfig`` holds the limits and sampling both use; ``EngineActivity`` measures engine idle
time. The loop itself is ``agent_loop.py``; the endpoint's episode, ``agent_endpoint/session.py``.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from megatron_sao.rollout.engines.protocol import GenerationResult, RolloutEngine, SamplingParams
from megatron_sao.rollout.env_calls import EnvCalls
from megatron_sao.trajectory import TrajectoryBuilder


class AbortRetriesExceeded(RuntimeError):
    """The engine aborted the same turn more than ``max_abort_retries`` times."""


class EngineCallError(RuntimeError):
    """The engine's ``generate`` raised: the server may be gone (the driver checks its health)."""


@dataclass(frozen=True)
class AgentLoopConfig:
    """Limits and sampling of the agent loop.

    ``sampling.max_new_tokens`` is replaced per turn by ``min(max_new_tokens_per_turn, tokens left)``;
    its stop ids are merged with the formatter's (EOS / end-of-turn).
    """

    max_turns: int = 8
    max_total_tokens: int = 4096  # prompt + actions + observations
    max_new_tokens_per_turn: int = 1024
    sampling: SamplingParams = SamplingParams(max_new_tokens=1024)
    max_concurrency: int = 16  # run_many: episodes in flight at once
    observation_role: str = "tool"  # role of the environment's replies in the chat template
    max_abort_retries: int = 16
    # MoE routing replay: every turn asks the engine for the routes of the tokens not yet covered
    # (routes_start) and stitches them into the trajectory's routed_experts (TrajectoryBuilder.add_routes)
    return_routes: bool = False
    # Bound of one environment reset() or step() (None: unbounded); past it the episode fails naming the
    # environment and the tool call (rollout/env_calls.py). The trainer sets rollout.timeout_s.
    env_timeout_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_total_tokens", "max_new_tokens_per_turn", "max_concurrency"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"AgentLoopConfig.{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.max_abort_retries, int) or self.max_abort_retries < 0:
            raise ValueError(f"AgentLoopConfig.max_abort_retries must be an int >= 0, got {self.max_abort_retries!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"AgentLoopConfig.sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if self.env_timeout_s is not None and not self.env_timeout_s > 0:
            raise ValueError(f"AgentLoopConfig.env_timeout_s must be > 0 or None, got {self.env_timeout_s!r}")


class EngineActivity:
    """Counts generate calls in flight to measure how long the engine sat with nothing to do.

    Idle time is wall time with zero requests in flight (every episode is waiting on its environment,
    or none is running): the quantity asynchrony is meant to drive to zero.
    """

    def __init__(self) -> None:
        self.active = 0
        self.idle_s = 0.0
        self._idle_since: float | None = time.monotonic()
        self.env_calls = EnvCalls()  # what the episodes not generating are waiting on

    def begin(self) -> None:
        if self.active == 0 and self._idle_since is not None:
            self.idle_s += time.monotonic() - self._idle_since
            self._idle_since = None
        self.active += 1

    def end(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle_since = time.monotonic()

    def total_idle_s(self) -> float:
        """Idle seconds so far, including the current idle stretch."""
        extra = time.monotonic() - self._idle_since if self._idle_since is not None else 0.0
        return self.idle_s + extra


def turn_seed(base: int | None, prompt_id: str, turn: int) -> int | None:
    """A distinct, reproducible seed per (prompt, turn) when the config fixes one.

    Passing one fixed seed to every request would give every episode the same sampling noise (and the
    same action for the same prefix), which is no longer sampling from the policy.
    """
    if base is None:
        return None
    digest = hashlib.blake2b(f"{base}/{prompt_id}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # non-negative int63


async def generate_turn(engine: RolloutEngine, prefix: list[int], sampling: SamplingParams, cfg: AgentLoopConfig,
                         info: dict, timings: dict, activity: EngineActivity | None) -> GenerationResult:
    """One assistant turn; an aborted request is re-generated from the same prefix (module docstring)."""
    while True:
        t0 = time.monotonic()
        if activity is not None:
            activity.begin()
        try:
            result = await engine.generate(list(prefix), sampling)
        except Exception as e:  # tagged for the driver's failover
            raise EngineCallError(f"{type(e).__name__}: {e}") from e
        finally:
            if activity is not None:
                activity.end()
            timings["generate_s"] += time.monotonic() - t0
        if result.finish_reason != "abort":
            break
        info["abort_retries"] += 1
        if info["abort_retries"] > cfg.max_abort_retries:
            raise AbortRetriesExceeded(f"engine aborted {info['abort_retries']} generate calls "
                                       f"(max_abort_retries={cfg.max_abort_retries})")
    n = len(result.token_ids)
    if n == 0:
        raise RuntimeError(f"engine returned no tokens (finish_reason={result.finish_reason!r})")
    if n > sampling.max_new_tokens:
        raise RuntimeError(f"engine returned {n} tokens for max_new_tokens={sampling.max_new_tokens}")
    return result


def add_turn_routes(b: TrajectoryBuilder, result: GenerationResult, prefix_len: int) -> None:
    """Stitch one turn's routes: the re-prefilled history before ``routes_start`` was covered by the
    earlier turns, so the engine returns the rest of the prefix and every sampled token but the last."""
    start = b.routes_covered
    expected = prefix_len - start + len(result.token_ids) - 1
    routes = result.routed_experts
    if routes is None or routes.dim() != 3 or routes.shape[0] != expected:
        got = None if routes is None else tuple(routes.shape)
        raise RuntimeError(f"engine returned routes {got} for tokens {start}..{start + expected - 1} "
                           f"({expected} rows expected)")
    b.add_routes(start, routes)
