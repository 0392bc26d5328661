"""Loss closures handed to `MegatronEngine.train_step`, one per algorithm and role.

The engine calls `loss_fn(output, micro_batch, loss_denominator)`; `output` is per-token log-probs
(actor) or state values (critic) for the micro-batch's rows. These closures only pick the right
fields out of the micro-batch and call the pure functions in megatron_sao.algorithms.

The policy loss also reports the lag-0 train/rollout log-prob mismatch from the log-probs the step
computes anyway (no extra forward): the micro-batch's `lag0_mask` marks the action tokens sampled
by the weights being trained, and before the update those weights are the learner's.
"""

from __future__ import annotations

import torch

from megatron_sao.algorithms import dis_policy_loss, entropy_bonus, ppo_clip_loss, value_loss
from megatron_sao.algorithms.losses import turn_bucket_names
from megatron_sao.config import AlgorithmConfig
from megatron_sao.trainer.targets import values_for_actions


def policy_loss_fn(algo: AlgorithmConfig):
    if algo.name == "grpo":
        # The paper's vanilla GRPO: the PPO ratio against the learner's own log-probs before the
        # update, no staleness correction. One optimizer step per batch, so the "old" policy is the
        # policy of this very forward pass: its detached log-probs are exactly what an old-policy
        # forward at the start of the step would return (ratio 1, gradient A * grad log p), at no
        # extra forward. Several updates per batch would need that forward; there are none here.
        def loss(logprobs, mb, denominator):
            return ppo_clip_loss(logprobs, logprobs.detach(), mb["advantages"], mb["action_mask"].bool(),
                                 algo.ppo_clip_low, algo.ppo_clip_high, loss_denominator=denominator)
    elif algo.name == "grpo_rollout_ratio":  # PPO clip against the sampler's log-probs
        def loss(logprobs, mb, denominator):
            return ppo_clip_loss(logprobs, mb["rollout_logprobs"], mb["advantages"], mb["action_mask"].bool(),
                                 algo.ppo_clip_low, algo.ppo_clip_high, loss_denominator=denominator)
    else:  # sao, grpo_dis, running_mean: direct double-sided IS masking against rollout log-probs
        def loss(logprobs, mb, denominator):
            return dis_policy_loss(logprobs, mb["rollout_logprobs"], mb["advantages"], mb["action_mask"].bool(),
                                   algo.eps_low, algo.eps_high, loss_denominator=denominator,
                                   turn_ids=mb.get("turn_ids"))
    if algo.entropy_coef > 0:
        loss = with_entropy_bonus(loss, algo.entropy_coef)
    return with_lag0_mismatch(loss)


def with_entropy_bonus(loss_fn, coef: float):
    """Add `entropy_bonus` (-coef x the token-mean entropy, from the micro-batch's differentiable
    `entropy`, megatron/forward.py) to a policy loss; its part of the loss is reported as
    `entropy_bonus_loss_sum` (its sum over micro-batches is the step's, like `loss`)."""
    def loss(logprobs, mb, denominator):
        value, metrics = loss_fn(logprobs, mb, denominator)
        bonus = entropy_bonus(mb["entropy"], mb["action_mask"].bool(), coef, loss_denominator=denominator)
        return value + bonus, {**metrics, "entropy_bonus_loss_sum": bonus.detach()}
    return loss


def dis_masked_share_by_turn(metrics: dict[str, float]) -> dict[str, float]:
    """From a DIS step's per-turn counts (algorithms.losses.turn_counts, summed over the batch):
    {"dis/masked_share_turn_<k>": masked / action tokens of turn k} for the turns the batch has."""
    out = {}
    for name in turn_bucket_names():
        n = metrics.get(f"action_turn_{name}_count", 0.0)
        if n > 0:
            out[f"dis/masked_share_turn_{name}"] = metrics[f"masked_turn_{name}_count"] / n
    return out


def lag0_mismatch_sums(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                       lag0_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"lag0_abs_diff_sum", "lag0_count"}: sum of |log p_train - log p_rollout| over `lag0_mask`, and
    its size, as float64 sums that add across micro-batches and data-parallel ranks."""
    mask = lag0_mask.bool()
    diff = (logprobs.detach() - rollout_logprobs).abs().to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=diff.device)
    return {"lag0_abs_diff_sum": torch.where(mask, diff, zero).sum(), "lag0_count": mask.sum().to(torch.float64)}


def with_lag0_mismatch(loss_fn):
    """Add `lag0_mismatch_sums` to a policy loss's metrics when the micro-batch has a `lag0_mask`."""
    def loss(logprobs, mb, denominator):
        value, metrics = loss_fn(logprobs, mb, denominator)
        if "lag0_mask" in mb:
            metrics = {**metrics, **lag0_mismatch_sums(logprobs, mb["rollout_logprobs"], mb["lag0_mask"])}
        return value, metrics
    return loss


def lag0_mismatch(metrics: dict[str, float]) -> float | None:
    """mean |log p_train - log p_rollout| over the step's lag-0 action tokens; None if it had none."""
    count = metrics.get("lag0_count", 0.0)
    return metrics["lag0_abs_diff_sum"] / count if count > 0 else None


def critic_loss_fn():
    def loss(state_values, mb, denominator):
        # The engine returns V(state ending at t); the target at action token t is for the state
        # before t (see targets.py), so shift before comparing.
        return value_loss(values_for_actions(state_values), mb["returns"], mb["action_mask"].bool(),
                          loss_denominator=denominator)
    return loss


def sft_loss_fn():
    """Negative log-likelihood of the demonstration's action tokens (token mean)."""
    import torch

    def loss(logprobs, mb, denominator):
        mask = mb["action_mask"].bool()
        nll = -(torch.where(mask, logprobs, torch.zeros_like(logprobs))).sum() / denominator
        return nll, {"nll_sum": (-(logprobs * mask).sum()).detach(), "tokens": mask.sum().float().detach()}
    return loss
