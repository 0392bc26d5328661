"""Advantages and critic targets for one batch, per algorithm (pure tensor code, no engines).

Value alignment. The critic engine returns at position t the value of the state that *ends* with
token t. The action at position t is taken in the state that ends with token t-1, so the value
that GAE pairs with action token t is `critic[:, t-1]` (verl and OpenRLHF align the same way).
The bootstrap value of a truncated trajectory is the value of the state after its last token,
`critic[:, length-1]`. The agent loop makes that a state the critic is trained on: a trajectory cut
inside an action ends mid-action (every such state precedes a sampled token somewhere), and one cut
after a stop token ends with the observation that follows it (the state before the next action's
first token, the V the GAE pairs with that token). Where that observation does not fit, the row asks
for the value of the state its stop token was sampled in, `critic[:, length-2]` (a trained state):
with the stop token's reward 0 its return is then that value (rollout/agent_loop.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_sao.algorithms import (
    RunningMeanBaseline,
    adaptive_lambda,
    broadcast_to_tokens,
    critic_fit,
    grpo_advantages,
    masked_whiten,
    skip_observation_gae,
    step_level_gae,
)
from megatron_sao.config import AlgorithmConfig
from megatron_sao.trajectory import TrajectoryBatch


@dataclass
class Targets:
    advantages: torch.Tensor  # [B, T], 0 off the action mask
    returns: torch.Tensor | None  # [B, T] critic targets (None without a critic)
    old_values: torch.Tensor | None  # [B, T] critic values aligned to actions
    metrics: dict[str, float] = field(default_factory=dict)


def values_for_actions(state_values: torch.Tensor) -> torch.Tensor:
    """Shift state-ending-at-t values right by one so position t holds V(state before token t)."""
    return torch.cat([torch.zeros_like(state_values[:, :1]), state_values[:, :-1]], dim=1)


def bootstrap_values(batch: TrajectoryBatch, state_values: torch.Tensor | None) -> torch.Tensor:
    """[B]: the critic's value after the last token for truncated rows that ask for it, the given
    value for truncated rows that carry one, 0 for terminated rows."""
    boot = batch.bootstrap_values.to(torch.float32).clone()
    if bool(batch.bootstrap_from_critic.any()):
        if state_values is None:
            raise ValueError("truncated trajectories need a critic to bootstrap from, but this algorithm "
                             "has none; give them a bootstrap value or use algorithm.name=sao")
        at = batch.bootstrap_state.clamp(min=0)
        from_critic = state_values.gather(1, at[:, None]).squeeze(1).to(boot.dtype)
        boot = torch.where(batch.bootstrap_from_critic, from_critic, boot)
    return boot


def critic_targets(batch: TrajectoryBatch, state_values: torch.Tensor,
                   algo: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values aligned to actions, bootstrap values [B], critic returns): lambda-returns with the
    critic's own lambda (1.0 = Monte Carlo returns). Independent of the policy's algorithm, so value
    pretraining uses it for any `algorithm.name`."""
    mask = batch.action_mask
    v = values_for_actions(state_values.to(torch.float32)) * mask
    boot = bootstrap_values(batch, state_values.to(torch.float32))
    _, returns = skip_observation_gae(batch.rewards.to(torch.float32), v, mask, algo.gamma, algo.critic_lambda, boot)
    return v, boot, returns


def mean_return(batch: TrajectoryBatch, algo: AlgorithmConfig) -> float:
    """Token-mean over the action tokens of the critic's returns with every value 0: the best constant
    value for the critic's token-mean loss (a fresh head's bias). Exact for terminated rows; a row
    that bootstraps from the critic counts that bootstrap as 0."""
    zeros = torch.zeros(batch.tokens.shape, dtype=torch.float32)
    _, _, returns = critic_targets(batch, zeros, algo)
    mask = batch.action_mask.float()
    return float((returns * mask).sum() / mask.sum().clamp(min=1))


def policy_lambda(chain_lengths: torch.Tensor, algo: AlgorithmConfig) -> torch.Tensor:
    """[B] policy lambda: the fixed `policy_lambda`, else SAO's adaptive 1 - 1/(alpha * l) with l the
    length of the chain the GAE runs over (action tokens; turns for step-level GAE), so the
    effective horizon is alpha times the chain length at either granularity."""
    if algo.policy_lambda is not None:
        return torch.full((chain_lengths.shape[0],), algo.policy_lambda, dtype=torch.float32)
    return adaptive_lambda(chain_lengths, algo.policy_alpha, dtype=torch.float32)


def compute_targets(batch: TrajectoryBatch, state_values: torch.Tensor | None, algo: AlgorithmConfig,
                    baseline: RunningMeanBaseline | None = None) -> Targets:
    mask = batch.action_mask
    rewards = batch.rewards.to(torch.float32)
    metrics: dict[str, float] = {}
    returns = old_values = None
    if algo.name == "sao":
        if state_values is None:
            raise ValueError("algorithm sao needs critic values")
        v, boot, returns = critic_targets(batch, state_values, algo)
        if algo.advantage == "token":
            lam = policy_lambda(mask.sum(1), algo)
            advantages, _ = skip_observation_gae(rewards, v, mask, algo.gamma, lam, boot)
        else:
            mode = "turn_avg" if algo.advantage == "step_avg" else "turn_last"
            lam = policy_lambda((batch.turn_ids.amax(dim=1) + 1).clamp(min=0), algo)
            advantages, _ = step_level_gae(rewards, v, mask, batch.turn_ids, algo.gamma, lam, mode, boot)
        metrics["policy_lambda_mean"] = float(lam.mean())
        old_values = v
    elif algo.uses_groups:
        per_traj = rewards.sum(1)
        groups = {pid: i for i, pid in enumerate(dict.fromkeys(batch.prompt_ids))}
        group_ids = torch.tensor([groups[p] for p in batch.prompt_ids])
        advantages = broadcast_to_tokens(grpo_advantages(per_traj, group_ids), mask)
    elif algo.name == "running_mean":
        if baseline is None:
            raise ValueError("algorithm running_mean needs a RunningMeanBaseline")
        per_traj = rewards.sum(1)
        metrics["baseline"] = float(baseline.value)
        advantages = broadcast_to_tokens(baseline.advantages(per_traj), mask)
        baseline.update(per_traj)
    else:
        raise ValueError(f"unknown algorithm {algo.name!r}")
    if algo.whiten_advantages:
        advantages = masked_whiten(advantages, mask) * mask
    m = mask.float()
    n = m.sum().clamp(min=1)
    metrics["advantage_mean"] = float((advantages * m).sum() / n)
    metrics["advantage_abs_mean"] = float((advantages.abs() * m).sum() / n)
    if returns is not None:
        metrics["return_mean"] = float((returns * m).sum() / n)
        # How well the critic predicted the returns before this step's updates: explained variance
        # (overall and per action turn), its mean against the returns' mean, the squared error.
        fit = critic_fit(old_values, returns, mask, batch.turn_ids)
        metrics.update({f"critic/{k}": v for k, v in fit.items() if k != "return_mean"})
    return Targets(advantages.to(torch.float32), returns, old_values, metrics)
