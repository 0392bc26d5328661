"""Pure tensor functions of the SAO algorithm (no I/O, no torch.distributed).

- advantages: skip-observation token GAE, adaptive lambda, step-level GAE (+ re-exported baselines)
- baselines:  GRPO group normalization, running-mean baseline, token broadcast
- losses:     DIS policy loss, PPO clip loss, value loss, entropy bonus
- metrics:    masked statistics, explained variance, log-prob mismatch, version-lag histogram
- scan:       the blocked discounted cumsum both GAEs reduce to
"""

from megatron_sao.algorithms.advantages import adaptive_lambda, skip_observation_gae, step_level_gae
from megatron_sao.algorithms.baselines import RunningMeanBaseline, broadcast_to_tokens, grpo_advantages
from megatron_sao.algorithms.losses import dis_policy_loss, entropy_bonus, ppo_clip_loss, value_loss
from megatron_sao.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from megatron_sao.algorithms.metrics import (
    critic_fit,
    explained_variance,
    logprob_mismatch,
    masked_max,
    version_lag_histogram,
)
from megatron_sao.algorithms.scan import discounted_cumsum

__all__ = [
    "skip_observation_gae",
    "adaptive_lambda",
    "step_level_gae",
    "grpo_advantages",
    "broadcast_to_tokens",
    "RunningMeanBaseline",
    "dis_policy_loss",
    "ppo_clip_loss",
    "value_loss",
    "entropy_bonus",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "masked_max",
    "explained_variance",
    "critic_fit",
    "logprob_mismatch",
    "version_lag_histogram",
    "discounted_cumsum",
]
