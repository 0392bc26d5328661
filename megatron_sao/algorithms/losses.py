"""Token-level losses: SAO's DIS policy loss, PPO/GRPO clip loss (baselines), critic value loss, and
the entropy bonus any policy loss may add.

Conventions shared by all:
- Inputs are [B, T]; ``action_mask`` (bool) marks the tokens the policy sampled. Targets
  (advantages, returns, old/rollout log-probs, old values) are detached inside.
- The loss is a token mean: sum over tokens / D, where D is the number of action tokens in the
  batch (tokens dropped by a mask or clip still count) or ``loss_denominator`` when given, and
  D is clamped to >= 1 so an empty batch gives 0. When the engine splits a batch into
  micro-batches and data-parallel ranks, it passes the global action-token count as
  ``loss_denominator``; the per-micro-batch losses then sum to the exact global mean.
- Masked-out positions enter through ``torch.where`` on the *inputs* of any exp/square (the
  "double where"), so their gradient is exactly 0 and no inf/NaN from them reaches autograd.
- Metrics are a dict of detached 0-dim float64 tensors on the input device, so the engine can
  stack and all-reduce them. Ratios (e.g. "kept_fraction") are for logging one micro-batch; the
  raw sums and counts (keys ending in "_count" / "_sum") add across micro-batches and ranks for
  exact aggregation ("ratio_max" combines with max). With no action token every metric is 0.
"""

from __future__ import annotations

import torch

from megatron_sao.algorithms._checks import (
    check_float_tensor,
    check_mask,
    check_positive,
    check_same_shape,
    check_unit_interval,
    loss_denominator_value,
)

Metrics = dict[str, torch.Tensor]


def _validate(logprobs: torch.Tensor, action_mask: torch.Tensor, **others: torch.Tensor) -> None:
    check_float_tensor(logprobs, "logprobs", ndim=2)
    check_mask(action_mask, "action_mask")
    for name, t in others.items():
        check_float_tensor(t, name)
    check_same_shape("logprobs", logprobs, action_mask=action_mask, **others)


def _ratio(count: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    return count / total.clamp(min=1)


def _ratio_stats(log_ratio: torch.Tensor, action_mask: torch.Tensor) -> Metrics:
    """Importance-ratio statistics over action tokens, in float64 (exp(100) still fits).

    ESS is the normalized effective sample size (sum r)^2 / (n * sum r^2) in (0, 1], computed
    with the max log-ratio factored out so that it stays finite even when r itself overflows.
    """
    lr = log_ratio.detach().to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=lr.device)
    n = action_mask.sum().to(torch.float64)
    ratio = torch.where(action_mask, torch.exp(torch.where(action_mask, lr, zero)), zero)
    ratio_sum = ratio.sum()
    if bool(n > 0):
        ratio_max = ratio.masked_fill(~action_mask, float("-inf")).max()
        peak = lr.masked_fill(~action_mask, float("-inf")).max()
        w = torch.where(action_mask, torch.exp(torch.where(action_mask, lr - peak, zero)), zero)
        ess = w.sum() ** 2 / (n * (w * w).sum())
    else:
        ratio_max, ess = zero, zero
    return {
        "action_count": n,
        "ratio_sum": ratio_sum,
        "ratio_sq_sum": (ratio * ratio).sum(),
        "ratio_mean": _ratio(ratio_sum, n),
        "ratio_max": ratio_max,
        "ess": ess,
    }


def dis_policy_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    loss_denominator: float | torch.Tensor | None = None,
    turn_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """SAO's direct double-sided importance sampling (DIS) policy loss.

        r_t    = exp(logprobs_t - rollout_logprobs_t)       (rollout = the sampler's own log-prob)
        keep_t = action_t and 1 - eps_low < r_t < 1 + eps_high   (strict on both sides)
        loss   = -sum_t keep_t * r_t * A_t / D

    Tokens outside the band are dropped (gradient exactly 0), not clipped; they still count in D.
    A NaN log-prob on an action token is neither kept, below nor above (so the three counts no
    longer add up to action_count) and shows as NaN in ratio_mean: visible, not silently averaged.
    Inside the band d loss / d logprobs_t = -r_t * A_t / D. The band test uses r computed in the
    dtype of ``logprobs`` against the bounds rounded to that dtype, so a ratio built as
    exp(log(0.7)) may land a rounding error either side of 0.7.

    Args:
        logprobs: [B, T] learner log-probs of the sampled tokens (requires grad).
        rollout_logprobs: [B, T] log-probs recorded by the rollout engine at sampling time.
        advantages: [B, T] (detached inside).
        action_mask: [B, T] bool.
        eps_low: in [0, 1]; lower band edge 1 - eps_low (paper: 0.3 math, 0.8 coding).
        eps_high: > 0; upper band edge 1 + eps_high (paper: 5.0 math, 3.0 coding).
        loss_denominator: global action-token count D (see module docstring); default local count.
        turn_ids: [B, T] int, the action turn of each action token (Trajectory.turn_ids); given, the
            metrics also count the masked (not kept) and all action tokens per turn (`turn_counts`).

    Returns:
        (loss, metrics): 0-dim loss; metrics kept/below/above fractions and counts, action_count,
        ratio_mean/ratio_max/ess and ratio_sum/ratio_sq_sum, all over action tokens.
    """
    _validate(logprobs, action_mask, rollout_logprobs=rollout_logprobs, advantages=advantages)
    eps_low = check_unit_interval(eps_low, "eps_low")
    eps_high = check_positive(eps_high, "eps_high")
    log_ratio = logprobs - rollout_logprobs.detach()
    ratio_detached = torch.exp(log_ratio.detach())
    below = action_mask & (ratio_detached <= 1.0 - eps_low)
    above = action_mask & (ratio_detached >= 1.0 + eps_high)
    kept = action_mask & (ratio_detached > 1.0 - eps_low) & (ratio_detached < 1.0 + eps_high)

    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    ratio = torch.exp(torch.where(kept, log_ratio, zero))  # exp(0) = 1 where dropped: no overflow
    per_token = torch.where(kept, ratio * advantages.detach(), zero)
    count = action_mask.sum()
    loss = -per_token.sum() / loss_denominator_value(loss_denominator, count, logprobs.dtype)

    metrics = _ratio_stats(log_ratio, action_mask)
    n = metrics["action_count"]
    for name, mask in (("kept", kept), ("below", below), ("above", above)):
        c = mask.sum().to(torch.float64)
        metrics[f"{name}_count"] = c
        metrics[f"{name}_fraction"] = _ratio(c, n)
    if turn_ids is not None:
        metrics.update(turn_counts(action_mask & ~kept, action_mask, turn_ids))
    return loss, metrics


# Turns with their own DIS count; later turns share the last bucket ("4plus").
TURN_BUCKETS = 5


def turn_bucket_names() -> list[str]:
    return [str(i) for i in range(TURN_BUCKETS - 1)] + [f"{TURN_BUCKETS - 1}plus"]


def turn_counts(masked: torch.Tensor, action_mask: torch.Tensor, turn_ids: torch.Tensor) -> Metrics:
    """{"masked_turn_<k>_count", "action_turn_<k>_count"} per turn bucket k (turn_bucket_names): how
    many of the action tokens of turn k a mask removed, and how many there are; float64 counts that
    add across micro-batches and ranks."""
    check_same_shape("masked", masked, action_mask=action_mask, turn_ids=turn_ids)
    bucket = turn_ids.clamp(max=TURN_BUCKETS - 1)
    out = {}
    for k, name in enumerate(turn_bucket_names()):
        in_turn = action_mask & (bucket == k)
        out[f"masked_turn_{name}_count"] = (masked & in_turn).sum().to(torch.float64)
        out[f"action_turn_{name}_count"] = in_turn.sum().to(torch.float64)
    return out


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    loss_denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO / GRPO clipped surrogate (the baselines), against the rollout (or old) log-probs.

        r_t    = exp(logprobs_t - old_logprobs_t)
        loss_t = max(-A_t * r_t, -A_t * clip(r_t, 1 - clip_low, 1 + clip_high))
        loss   = sum_{action t} loss_t / D

    A token is "clipped" when the clipped term is strictly the larger one; its gradient is then 0.
    Computed as ``where(clipped, constant, -A * r)`` rather than ``torch.maximum`` so that a
    clipped token with an overflowing ratio gives gradient 0 instead of 0 * inf = NaN (values
    and gradients otherwise equal the textbook form).

    Args:
        logprobs, old_logprobs, advantages: [B, T]; old_logprobs and advantages detached inside.
        action_mask: [B, T] bool.
        clip_low: in [0, 1]; clip_high: >= 0 (symmetric PPO: both 0.2; DAPO clip-higher: 0.2/0.28).
        loss_denominator: as in ``dis_policy_loss``.

    Returns:
        (loss, metrics): clip_fraction/clip_count, action_count, approx_kl (k3 estimator
        E[r - 1 - log r]) and approx_kl_sum, plus the ratio statistics of ``dis_policy_loss``.
    """
    _validate(logprobs, action_mask, old_logprobs=old_logprobs, advantages=advantages)
    clip_low = check_unit_interval(clip_low, "clip_low")
    clip_high = check_positive(clip_high, "clip_high", allow_zero=True)
    adv = advantages.detach()
    log_ratio = logprobs - old_logprobs.detach()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)

    ratio_detached = torch.exp(torch.where(action_mask, log_ratio.detach(), zero))
    clipped_ratio = ratio_detached.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = action_mask & (-adv * clipped_ratio > -adv * ratio_detached)
    live = action_mask & ~clipped  # tokens whose unclipped term is the loss (gradient flows)
    ratio = torch.exp(torch.where(live, log_ratio, zero))
    per_token = torch.where(live, -adv * ratio, torch.where(clipped, -adv * clipped_ratio, zero))
    count = action_mask.sum()
    loss = per_token.sum() / loss_denominator_value(loss_denominator, count, logprobs.dtype)

    metrics = _ratio_stats(log_ratio, action_mask)
    n = metrics["action_count"]
    lr = log_ratio.detach().to(torch.float64)
    zero64 = torch.zeros((), dtype=torch.float64, device=lr.device)
    lr_action = torch.where(action_mask, lr, zero64)
    kl_sum = torch.where(action_mask, torch.expm1(lr_action) - lr_action, zero64).sum()
    clip_count = clipped.sum().to(torch.float64)
    metrics.update(
        clip_count=clip_count,
        clip_fraction=_ratio(clip_count, n),
        approx_kl_sum=kl_sum,
        approx_kl=_ratio(kl_sum, n),
    )
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    old_values: torch.Tensor | None = None,
    clip: float | None = None,
    loss_denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Masked critic MSE, optionally with PPO-style value clipping.

        loss_t = 0.5 * (V_t - R_t)^2
        clipped (clip given):  V'_t = V_old,t + clamp(V_t - V_old,t, -clip, clip)
                               loss_t = 0.5 * max((V_t - R_t)^2, (V'_t - R_t)^2)
        loss = sum_{action t} loss_t / D

    Args:
        values: [B, T] critic predictions (requires grad).
        returns: [B, T] targets (detached inside), e.g. from ``skip_observation_gae`` with lam=1.
        action_mask: [B, T] bool.
        old_values: [B, T] values at rollout/batch time; required when ``clip`` is given.
        clip: > 0, or None for plain MSE.
        loss_denominator: as in ``dis_policy_loss``.

    Returns:
        (loss, metrics): action_count, sq_error_sum, value_sum, return_sum, value_mean,
        return_mean and, with clipping, clip_count / clip_fraction (tokens whose clipped error
        is strictly the larger).
    """
    check_float_tensor(values, "values", ndim=2)
    check_mask(action_mask, "action_mask")
    check_float_tensor(returns, "returns")
    check_same_shape("values", values, returns=returns, action_mask=action_mask)
    if clip is not None:
        clip = check_positive(clip, "clip")
        if old_values is None:
            raise ValueError("value_loss: clip requires old_values")
    if old_values is not None:
        check_float_tensor(old_values, "old_values")
        check_same_shape("values", values, old_values=old_values)

    target = returns.detach()
    # Masked positions see V = R (error 0) before any square, so NaN values there get gradient 0.
    v = torch.where(action_mask, values, target)
    sq = (v - target) ** 2
    clipped = torch.zeros_like(action_mask)
    if clip is not None:
        old = torch.where(action_mask, old_values.detach(), target)
        v_clipped = old + (v - old).clamp(-clip, clip)
        sq_clipped = (v_clipped - target) ** 2
        clipped = action_mask & (sq_clipped > sq)
        sq = torch.maximum(sq, sq_clipped)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    per_token = torch.where(action_mask, 0.5 * sq, zero)
    count = action_mask.sum()
    loss = per_token.sum() / loss_denominator_value(loss_denominator, count, values.dtype)

    def total(x: torch.Tensor) -> torch.Tensor:
        x64 = x.detach().to(torch.float64)
        return torch.where(action_mask, x64, torch.zeros((), dtype=torch.float64, device=x.device)).sum()

    n = count.to(torch.float64)
    value_sum, return_sum = total(v), total(target)
    clip_count = clipped.sum().to(torch.float64)
    metrics = {
        "action_count": n,
        "sq_error_sum": total(sq),
        "value_sum": value_sum,
        "return_sum": return_sum,
        "value_mean": _ratio(value_sum, n),
        "return_mean": _ratio(return_sum, n),
        "clip_count": clip_count,
        "clip_fraction": _ratio(clip_count, n),
    }
    return loss, metrics


def entropy_bonus(
    entropy: torch.Tensor,
    action_mask: torch.Tensor,
    coef: float,
    loss_denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The term a policy loss adds to keep the policy sampling: -coef * token-mean entropy.

        loss = -coef * sum_{action t} H_t / D,   H_t = -sum_v p(v | s_t) log p(v | s_t)

    (verl's ``entropy_coeff``, slime's ``--entropy-coef``). SAO's paper trains without it (coef 0);
    it is here for runs where the policy collapses onto one behaviour faster than the task changes
    (the style-shift task's preference switches, docs/results.md section 4).

    Args:
        entropy: [B, T] the entropy of the distribution each token was sampled from (differentiable:
            megatron/logprobs.py computes its gradient in the log-prob pass).
        action_mask: [B, T] bool.
        coef: >= 0.
        loss_denominator: as in ``dis_policy_loss``.

    Returns:
        the 0-dim term (the engine already reports the token-mean entropy as a metric).
    """
    check_float_tensor(entropy, "entropy", ndim=2)
    check_mask(action_mask, "action_mask")
    check_same_shape("entropy", entropy, action_mask=action_mask)
    coef = check_positive(coef, "coef", allow_zero=True)
    per_token = torch.where(action_mask, entropy, torch.zeros((), dtype=entropy.dtype, device=entropy.device))
    count = action_mask.sum()
    return -coef * per_token.sum() / loss_denominator_value(loss_denominator, count, entropy.dtype)
