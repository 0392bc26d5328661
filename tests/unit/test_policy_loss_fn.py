"""The policy loss closures the trainer hands to the engine: which log-probs each GRPO takes its
ratio against, the lag-0 mismatch measured from the train step's own log-probs, and the entropy bonus."""

from __future__ import annotations

import pytest
import torch

from megatron_sao.algorithms import logprob_mismatch
from megatron_sao.config import AlgorithmConfig
from megatron_sao.trainer.losses import policy_loss_fn

torch.set_num_threads(1)


def micro_batch(rollout_shift: float = 0.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[False, True, True, True, False], [False, False, True, True, True]])
    logprobs = (-torch.rand(2, 5, generator=g, dtype=torch.float64) - 0.1).requires_grad_()
    rollout = torch.where(mask, logprobs.detach() - 0.5 + rollout_shift * torch.rand(2, 5, generator=g), 0)
    mb = {"action_mask": mask, "rollout_logprobs": rollout.to(torch.float64),
          "advantages": torch.where(mask, torch.randn(2, 5, generator=g, dtype=torch.float64), 0)}
    return logprobs, mb


def loss_and_grad(name: str, logprobs, mb):
    fn = policy_loss_fn(AlgorithmConfig(name=name))
    lp = logprobs.detach().clone().requires_grad_()
    loss, metrics = fn(lp, mb, torch.tensor(6.0, dtype=torch.float64))
    loss.backward()
    return loss.detach(), lp.grad, metrics


def test_vanilla_grpo_ratio_is_against_the_learners_own_logprobs():
    """One update per batch: the pre-update policy is this forward's, so the ratio is 1 and the
    gradient is the plain policy gradient -A * d log p / D, whatever the sampler recorded."""
    logprobs, mb = micro_batch()
    loss, grad, metrics = loss_and_grad("grpo", logprobs, mb)
    _, other_mb = micro_batch(rollout_shift=3.0)
    loss2, grad2, _ = loss_and_grad("grpo", logprobs, {**mb, "rollout_logprobs": other_mb["rollout_logprobs"]})
    assert torch.equal(loss, loss2) and torch.equal(grad, grad2)  # no staleness correction
    assert torch.allclose(grad, -mb["advantages"] * mb["action_mask"] / 6.0)
    assert metrics["ratio_max"] == 1.0 and metrics["clip_count"] == 0


def test_grpo_rollout_ratio_keeps_the_previous_behaviour():
    """The named variant takes the PPO ratio against the rollout log-probs (here all r = e^0.5 > 1.28:
    positive advantages are clipped)."""
    logprobs, mb = micro_batch()
    _, grad, metrics = loss_and_grad("grpo_rollout_ratio", logprobs, mb)
    _, vanilla_grad, _ = loss_and_grad("grpo", logprobs, mb)
    assert not torch.allclose(grad, vanilla_grad)
    assert metrics["ratio_mean"] == pytest.approx(float(torch.exp(torch.tensor(0.5))))
    assert metrics["clip_count"] == int(((mb["advantages"] > 0) & mb["action_mask"]).sum())


@pytest.mark.parametrize("name", ["sao", "grpo", "grpo_rollout_ratio", "grpo_dis", "running_mean"])
def test_lag0_mismatch_comes_from_the_loss_forward(name):
    from megatron_sao.trainer.losses import lag0_mismatch

    logprobs, mb = micro_batch(rollout_shift=1.0)
    lag0 = mb["action_mask"] & torch.tensor([[True, True, False, True, True], [True] * 5])
    loss_fn = policy_loss_fn(AlgorithmConfig(name=name))
    _, metrics = loss_fn(logprobs, {**mb, "lag0_mask": lag0}, torch.tensor(6.0))
    want = logprob_mismatch(logprobs.detach(), mb["rollout_logprobs"], lag0)
    assert metrics["lag0_count"] == int(lag0.sum())
    assert lag0_mismatch({k: float(v) for k, v in metrics.items()}) == pytest.approx(float(want), rel=1e-12)
    _, without = loss_fn(logprobs, mb, torch.tensor(6.0))
    assert "lag0_count" not in without and lag0_mismatch({}) is None
    _, none_lag0 = loss_fn(logprobs, {**mb, "lag0_mask": torch.zeros_like(lag0)}, torch.tensor(6.0))
    assert lag0_mismatch({k: float(v) for k, v in none_lag0.items()}) is None


def test_dis_masked_share_per_turn_counts_the_tokens_the_band_drops_in_each_turn():
    """Turn 0 has one of two tokens outside the DIS band, turn 1 none, turn 6 (in the last bucket
    "4plus") both; summed over two micro-batches like the engine does."""
    from megatron_sao.trainer.losses import dis_masked_share_by_turn

    mask = torch.tensor([[False, True, True, True, True, True, True]])
    turns = torch.tensor([[-1, 0, 0, 1, 1, 6, 6]])
    logprobs = torch.full((1, 7), -1.0, dtype=torch.float64)
    # r = exp(lp - rollout): 1 (kept), e^-1 = 0.37 <= 0.7 (below), 1, 1, e^2 = 7.4 >= 6 (above), e^-1
    rollout = logprobs - torch.tensor([[0.0, 0.0, -1.0, 0.0, 0.0, 2.0, -1.0]], dtype=torch.float64)
    mb = {"action_mask": mask, "rollout_logprobs": rollout, "advantages": torch.ones(1, 7, dtype=torch.float64),
          "turn_ids": turns}
    fn = policy_loss_fn(AlgorithmConfig(name="sao"))
    _, metrics = fn(logprobs.clone().requires_grad_(), mb, torch.tensor(6.0, dtype=torch.float64))
    summed = {k: 2 * float(v) for k, v in metrics.items() if k.endswith("_count")}  # two identical micro-batches
    shares = dis_masked_share_by_turn(summed)
    assert shares == {"dis/masked_share_turn_0": 0.5, "dis/masked_share_turn_1": 0.0,
                      "dis/masked_share_turn_4plus": 1.0}
    assert float(metrics["below_count"] + metrics["above_count"]) == 3.0


@pytest.mark.parametrize("name", ["sao", "grpo", "grpo_dis", "running_mean"])
def test_entropy_coef_adds_minus_coef_times_the_token_mean_entropy(name):
    """The bonus is the same term for every policy loss: -coef * sum of the action tokens' entropy / D,
    its gradient -coef / D on each action token's entropy and none elsewhere; at coef 0 the closure
    never reads the micro-batch's entropy (the paper's loss, unchanged)."""
    logprobs, mb = micro_batch()
    entropy = torch.rand(2, 5, dtype=torch.float64).requires_grad_()
    denominator = torch.tensor(6.0, dtype=torch.float64)
    base, base_metrics = policy_loss_fn(AlgorithmConfig(name=name))(logprobs, mb, denominator)
    with_bonus, metrics = policy_loss_fn(AlgorithmConfig(name=name, entropy_coef=0.05))(
        logprobs, {**mb, "entropy": entropy}, denominator)
    masked_sum = (entropy.detach() * mb["action_mask"]).sum()
    assert float(with_bonus - base) == pytest.approx(-0.05 * float(masked_sum) / 6.0, rel=1e-12)
    assert float(metrics["entropy_bonus_loss_sum"]) == pytest.approx(-0.05 * float(masked_sum) / 6.0, rel=1e-12)
    assert "entropy_bonus_loss_sum" not in base_metrics
    with_bonus.backward()
    assert torch.allclose(entropy.grad, mb["action_mask"].double() * (-0.05 / 6.0), rtol=1e-12, atol=0)
