"""One SAO trainer step, the whole algorithm: `sao_step`. The lifecycle around it (batches from the
buffer, weight push, logging, checkpoints, signals, the stop agreement) is `loop.py::SAOTrainer`.

    batch (the oldest finished trajectories, one per prompt)
      -> critic values of every state
      -> skip-observation GAE: returns (critic lambda), advantages (length-adaptive policy lambda)
      -> K critic steps on those fixed returns
      -> after the critic warm-up: one actor step with the DIS loss
    the caller then pushes the actor's weights to the rollout servers (policy version + 1).

Every call here is collective: all ranks run `sao_step` on the same batch (rank 0 broadcast it).
The critic-free baselines (`grpo*`, `running_mean`) run the same function with `critic=None`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from megatron_sao.config import AlgorithmConfig
from megatron_sao.trainer.losses import dis_masked_share_by_turn, lag0_mismatch
from megatron_sao.trainer.targets import compute_targets
from megatron_sao.trajectory import TrajectoryBatch

if TYPE_CHECKING:
    from megatron_sao.algorithms import RunningMeanBaseline
    from megatron_sao.megatron.engine import MegatronEngine, StepResult

# What a run computes from a given config. Bump it with every change that makes the same config and
# overrides train differently (a default's meaning, a loss, the targets, what the buffer hands the
# trainer, a rollout's bootstrap): the paper-claims suite's run cache (benchmarks/reproduce/runner.py)
# keys on it, so runs computed before such a change are never reused in a report after it.
#   1: the suite's first results.
#   2: issue 12: staleness_policy keep by default; vanilla `grpo` against the learner's own
#      log-probs; the critic freezes embeddings, router and norms too; the truncation bootstrap reads
#      a trained state; the step-level ablation keeps the adaptive lambda.
#   3: issue 26: a trajectory whose last observation does not fit bootstraps from the value of the
#      state its stop token was sampled in, not 0.
#   4: issue 35: a critic built from a policy starts with a zero value head (was N(0, 0.02)) whose bias is
#      the first batch's mean return; the critic logs EV by turn, value mean and squared error.
ALGORITHM_VERSION = 4

# Called after every optimizer step with (result, "actor" | "critic"); it may raise to stop the run
# (the trainer's non-finite policy does, after a checkpoint), before the next step starts.
StepCheck = Callable[["StepResult", str], None]


@dataclass
class StepOutcome:
    actor_updated: bool  # the actor took an optimizer step: its weights are a new policy version
    metrics: dict[str, float] = field(default_factory=dict)


def sao_step(batch: TrajectoryBatch, actor: MegatronEngine, critic: MegatronEngine | None, algo: AlgorithmConfig, *,
             policy_loss, critic_loss, version: int, train_actor: bool,
             baseline: RunningMeanBaseline | None = None, check: StepCheck = lambda result, role: None) -> StepOutcome:
    """One trainer step on `batch`. `version` is the actor's policy version before the step (tokens
    it sampled are lag 0); `train_actor` is False during the critic warm-up."""
    fields = model_inputs(batch)
    m: dict[str, float] = {}

    # 1. The critic's value of every state (the critic-free baselines have none).
    t0 = time.monotonic()
    values = critic.values(fields) if critic is not None else None
    m["time/critic_forward_s"] = time.monotonic() - t0

    # 2. Targets: skip-observation GAE over the action tokens (trainer/targets.py).
    targets = compute_targets(batch, values, algo, baseline)
    m.update(targets.metrics)
    fields["advantages"] = targets.advantages

    # 3. K critic steps on the fixed returns.
    if critic is not None:
        fields["returns"] = targets.returns
        t0 = time.monotonic()
        for _ in range(algo.critic_steps):
            result = critic.train_step(fields, critic_loss)
            check(result, "critic")
        m["time/critic_train_s"] = time.monotonic() - t0
        m.update(step_metrics("critic", result))

    # 4. After the warm-up: one actor step. The loss also measures the train/rollout log-prob
    #    mismatch of the tokens these very weights sampled, from the step's own forward (losses.py).
    if not train_actor:
        return StepOutcome(actor_updated=False, metrics=m)
    fields["lag0_mask"] = batch.action_mask & (batch.versions == version)
    if batch.routes is not None:  # the engines' experts: replayed (rollout.routing_replay) or only compared
        fields["routes"] = batch.routes
    t0 = time.monotonic()
    result = actor.train_step(fields, policy_loss)
    m["time/actor_train_s"] = time.monotonic() - t0
    check(result, "actor")
    if (mismatch := lag0_mismatch(result.metrics)) is not None:
        m["logprob_mismatch_lag0"] = mismatch
    m.update({k: v for k, v in result.metrics.items() if k.startswith("moe/")})
    m.update(dis_masked_share_by_turn(result.metrics))
    m.update(step_metrics("actor", result))
    return StepOutcome(actor_updated=not result.skipped, metrics=m)


def model_inputs(batch: TrajectoryBatch) -> dict[str, torch.Tensor]:
    """The batch's per-token [B, T] tensors (tokens, masks, rollout log-probs, versions, ...) as the
    engines take them."""
    fields = {k: v for k, v in batch.to_dict().items() if v.dim() == 2}
    fields["attention_mask"] = batch.attention_mask
    return fields


def step_metrics(role: str, result: StepResult) -> dict[str, float]:
    return {**{f"{role}/{k}": v for k, v in result.metrics.items()}, f"{role}/grad_norm": result.grad_norm}
