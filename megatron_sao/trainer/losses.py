"""Loss closures handed to `MegatronEngine.train_step`, one per algorithm and role.

The engine calls `loss_fn(output, micro_batch, loss_denominator)`; `output` is per-token log-probs
(actor) or state values (critic) for the micro-batch's rows. These closures only pick the right
fields out of the micro-batch and call the pure functions in megatron_sao.algorithms.
"""

from __future__ import annotations

from megatron_sao.algorithms import dis_policy_loss, ppo_clip_loss, value_loss
from megatron_sao.config import AlgorithmConfig
from megatron_sao.trainer.targets import values_for_actions


def policy_loss_fn(algo: AlgorithmConfig):
    if algo.name == "grpo":
        def loss(logprobs, mb, denominator):
            return ppo_clip_loss(logprobs, mb["rollout_logprobs"], mb["advantages"], mb["action_mask"].bool(),
                                 algo.ppo_clip_low, algo.ppo_clip_high, loss_denominator=denominator)
    else:  # sao, grpo_dis, running_mean: direct double-sided IS masking against rollout log-probs
        def loss(logprobs, mb, denominator):
            return dis_policy_loss(logprobs, mb["rollout_logprobs"], mb["advantages"], mb["action_mask"].bool(),
                                   algo.eps_low, algo.eps_high, loss_denominator=denominator)
    return loss


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
