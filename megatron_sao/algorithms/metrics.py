"""Training diagnostics over action tokens: critic fit, train/rollout log-prob mismatch, staleness.

All functions are pure and detached (they run under ``torch.no_grad``); the masked reductions
they build on (``masked_sum``, ``masked_mean``, ``masked_var``, ``masked_whiten``) are
re-exported from ``masked.py`` so callers find every masked statistic here.
"""

from __future__ import annotations

import torch

from megatron_sao.algorithms._checks import check_float_tensor, check_mask, check_same_shape, check_tensor
from megatron_sao.algorithms.masked import masked_count, masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "masked_sum",
    "masked_count",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "masked_max",
    "explained_variance",
    "critic_fit",
    "logprob_mismatch",
    "version_lag_histogram",
]


@torch.no_grad()
def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """max_{mask} x as a 0-dim tensor; 0 for an empty mask."""
    check_float_tensor(x, "x")
    check_mask(mask, "mask", shape=x.shape)
    if not bool(mask.any()):
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return x.masked_fill(~mask, float("-inf")).max()


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """EV = 1 - Var[R - V] / Var[R] over masked tokens (biased variances).

    1 is a perfect critic, 0 no better than predicting the mean return, negative worse than that.
    Undefined when Var[R] is 0 (every return equal, or fewer than two tokens) or only rounding
    noise: returns NaN, so a dashboard shows a gap rather than a fabricated number. "Rounding
    noise" is Var[R] <= 1e-10 * (E[R^2] + E[V^2]): with all rewards 0, returns R = A + V come out
    near 1e-7 in float32 instead of exactly 0, which would otherwise read as EV = -1e13.
    """
    check_float_tensor(values, "values")
    check_float_tensor(returns, "returns")
    check_same_shape("values", values, returns=returns)
    var_returns = masked_var(returns, mask)
    var_residual = masked_var(returns - values, mask)
    scale = masked_mean(returns * returns, mask) + masked_mean(values * values, mask)
    nan = torch.full((), float("nan"), dtype=values.dtype, device=values.device)
    # The division is evaluated everywhere but only selected where Var[R] is real (no grad here).
    return torch.where(var_returns > 1e-10 * scale, 1.0 - var_residual / var_returns, nan)


@torch.no_grad()
def logprob_mismatch(train_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mean_{mask} |train_lp - rollout_lp|: how far the learner's log-probs are from the sampler's.

    With fresh weights this measures the engine mismatch alone (kernels, precision, sampling
    settings); staleness adds to it. 0 for an empty mask.
    """
    check_float_tensor(train_lp, "train_lp")
    check_float_tensor(rollout_lp, "rollout_lp")
    check_same_shape("train_lp", train_lp, rollout_lp=rollout_lp)
    return masked_mean((train_lp - rollout_lp).abs(), mask)


@torch.no_grad()
def version_lag_histogram(
    versions: torch.Tensor, action_mask: torch.Tensor, current_version: int
) -> dict[int, int]:
    """Count action tokens by policy lag: {current_version - versions_t: number of tokens}.

    Lag 0 means sampled by the current weights; an asynchronous trainer sees a spread of lags, and
    the histogram shows how stale a batch is. Keys are sorted ascending.

    Raises:
        ValueError: an action token has a version < 0 (unset) or > current_version (from the future).
    """
    check_tensor(versions, "versions")
    if versions.dtype.is_floating_point or versions.dtype == torch.bool:
        raise TypeError(f"versions must be an integer tensor, got dtype {versions.dtype}")
    check_mask(action_mask, "action_mask", shape=versions.shape)
    if isinstance(current_version, bool) or not isinstance(current_version, int):
        raise TypeError(f"current_version must be an int, got {type(current_version).__name__}")
    sampled = versions[action_mask].long()
    if bool((sampled < 0).any()):
        raise ValueError("versions must be >= 0 on action tokens (found an unset version -1)")
    if bool((sampled > current_version).any()):
        raise ValueError(
            f"versions on action tokens exceed current_version {current_version} (max {int(sampled.max())})"
        )
    lags, counts = torch.unique(current_version - sampled, return_counts=True)
    return {int(lag): int(n) for lag, n in zip(lags.tolist(), counts.tolist())}


# Action turns with their own explained variance in `critic_fit`; later turns share the last bucket.
EV_TURN_BUCKETS = 8


@torch.no_grad()
def critic_fit(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               turn_ids: torch.Tensor | None = None) -> dict[str, float]:
    """How well `values` (aligned to actions) predict `returns` over the action tokens of `mask`.

    Keys: ``explained_variance``; ``value_mean`` and ``return_mean`` (a critic can explain variance
    and still sit at the wrong level, which biases every advantage the same way); ``value_mse``
    (token-mean squared error; `value_loss` without clipping is half of it); and with
    ``turn_ids`` ``ev_turn_<k>`` per action turn (``<K-1>plus`` for the rest; NaN where a turn's
    returns do not vary): where in an episode the critic reads the return and where it does not.
    """
    check_float_tensor(values, "values")
    check_float_tensor(returns, "returns")
    check_same_shape("values", values, returns=returns)
    check_mask(mask, "mask", shape=values.shape)
    out = {"explained_variance": float(explained_variance(values, returns, mask)),
           "value_mean": float(masked_mean(values, mask)), "return_mean": float(masked_mean(returns, mask)),
           "value_mse": float(masked_mean((values - returns) ** 2, mask))}
    if turn_ids is not None:
        check_same_shape("values", values, turn_ids=turn_ids)
        bucket = turn_ids.clamp(max=EV_TURN_BUCKETS - 1)
        for k in range(EV_TURN_BUCKETS):
            in_turn = mask & (bucket == k)
            if bool(in_turn.any()):
                name = str(k) if k < EV_TURN_BUCKETS - 1 else f"{k}plus"
                out[f"ev_turn_{name}"] = float(explained_variance(values, returns, in_turn))
    return out
