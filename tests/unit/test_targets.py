"""Per-algorithm targets: value alignment, bootstrap from the critic, baselines."""

import pytest
import torch

from megatron_sao.algorithms import RunningMeanBaseline, skip_observation_gae
from megatron_sao.config import AlgorithmConfig
from megatron_sao.trainer.targets import compute_targets, values_for_actions
from megatron_sao.trajectory import TrajectoryBuilder, collate_padded


def _traj(pid, reward, status="terminated"):
    b = TrajectoryBuilder(prompt_id=pid)
    b.add_prompt([1, 2])
    b.add_action([3, 4], [-0.1, -0.2], 0)
    b.add_observation([5])
    b.add_action([6], [-0.3], 0)
    return b.finish(status, reward=reward)


def test_sao_targets_use_shifted_values_and_critic_bootstrap():
    batch = collate_padded([_traj("a", 1.0), _traj("b", 0.0, status="truncated")])
    state_values = torch.arange(12, dtype=torch.float32).reshape(2, 6) / 10
    algo = AlgorithmConfig(policy_alpha=1.5, critic_lambda=1.0)
    t = compute_targets(batch, state_values, algo)
    v = values_for_actions(state_values) * batch.action_mask
    assert torch.equal(v[:, 3], state_values[:, 2])  # action at t pairs with V(state ending at t-1)
    boot = torch.tensor([0.0, float(state_values[1, 5])])  # truncated row: V(after its last token)
    _, ret = skip_observation_gae(batch.rewards, v, batch.action_mask, 1.0, 1.0, boot)
    assert torch.allclose(t.returns, ret)
    assert torch.allclose(t.returns[1][batch.action_mask[1]], torch.full((3,), float(state_values[1, 5])))
    lam = 1 - 1 / (1.5 * 3)
    adv, _ = skip_observation_gae(batch.rewards, v, batch.action_mask, 1.0, torch.tensor([lam, lam]), boot)
    assert torch.allclose(t.advantages, adv)
    assert (t.advantages[~batch.action_mask] == 0).all()


def test_no_room_for_the_observation_returns_the_value_of_the_stop_tokens_state():
    """A trajectory cut after a stop token whose observation does not fit (agent_loop's
    "no_room_for_observation") is a cut episode, not a failure: its return is the critic's value
    of the state its stop token was sampled in, not 0."""
    b = TrajectoryBuilder(prompt_id="c")
    b.add_prompt([1, 2])
    b.add_action([3, 4], [-0.1, -0.2], 0)  # ends with its stop token, no observation after it
    cut = b.finish("truncated", bootstrap="critic_before_stop")
    batch = collate_padded([_traj("a", 1.0), cut])
    assert batch.bootstrap_state.tolist() == [-1, 2]  # the state ending at token 2, before the stop token 4
    state_values = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, -0.2, 0.9, 0.4, 0.0, 0.0]])
    t = compute_targets(batch, state_values, AlgorithmConfig(critic_lambda=1.0))
    assert torch.allclose(t.returns[1][batch.action_mask[1]], torch.tensor([0.9, 0.9]))
    assert t.advantages[1, 3] == 0.0  # the stop token: gamma*V(before stop) - V(before stop) with gamma 1
    with pytest.raises(ValueError, match="critic_before_stop"):
        b2 = TrajectoryBuilder(prompt_id="d")
        b2.add_prompt([1, 2])
        b2.add_action([3], [-0.1], 0)
        b2.add_observation([5])
        b2.finish("truncated", bootstrap="critic_before_stop")  # ends with an observation


def test_grpo_targets_are_group_normalized():
    batch = collate_padded([_traj("a", 1.0), _traj("a", 0.0), _traj("b", 1.0), _traj("b", 1.0)])
    t = compute_targets(batch, None, AlgorithmConfig(name="grpo"))
    per_row = [float(t.advantages[i][batch.action_mask[i]].unique()) for i in range(4)]
    assert per_row[0] > 0 > per_row[1] and per_row[2] == per_row[3] == 0.0
    assert t.returns is None


def test_running_mean_baseline_lags_behind():
    base = RunningMeanBaseline(window=4)
    algo = AlgorithmConfig(name="running_mean")
    b1 = collate_padded([_traj("a", 1.0), _traj("b", 1.0)])
    t1 = compute_targets(b1, None, algo, base)
    assert torch.allclose(t1.advantages[b1.action_mask], torch.ones(6))  # baseline started at 0
    t2 = compute_targets(b1, None, algo, base)
    assert torch.allclose(t2.advantages[b1.action_mask], torch.zeros(6))  # window now holds 1, 1


def test_step_level_ablation_uses_the_adaptive_lambda_over_its_turns():
    """Step-level GAE changes only the granularity: lambda is SAO's adaptive one over the chain it
    runs on (turns), not a fixed 1."""
    from megatron_sao.algorithms import step_level_gae

    batch = collate_padded([_traj("a", 1.0), _traj("b", 0.0)])
    state_values = torch.tensor([[0.1, 0.4, -0.3, 0.9, 0.2, 0.5], [0.3, -0.2, 0.6, 0.1, 0.7, -0.4]])
    algo = AlgorithmConfig(advantage="step_avg", policy_alpha=1.5)
    t = compute_targets(batch, state_values, algo)
    v = values_for_actions(state_values) * batch.action_mask
    lam = torch.full((2,), 1 - 1 / (1.5 * 2))  # two turns per trajectory
    want, _ = step_level_gae(batch.rewards, v, batch.action_mask, batch.turn_ids, 1.0, lam, "turn_avg")
    assert torch.allclose(t.advantages, want)
    with_one, _ = step_level_gae(batch.rewards, v, batch.action_mask, batch.turn_ids, 1.0, 1.0, "turn_avg")
    assert not torch.allclose(t.advantages, with_one)  # the old fixed lambda = 1 gives other advantages
    assert t.metrics["policy_lambda_mean"] == pytest.approx(float(lam[0]))


def test_critic_targets_do_not_depend_on_the_policy_algorithm():
    """What `sao value-pretrain` fits: the same returns whatever algorithm.name says."""
    from megatron_sao.trainer.targets import critic_targets

    batch = collate_padded([_traj("a", 1.0), _traj("a", 0.0, status="truncated")])
    state_values = torch.arange(12, dtype=torch.float32).reshape(2, 6) / 10
    sao = compute_targets(batch, state_values, AlgorithmConfig())
    for name in ("sao", "grpo", "grpo_rollout_ratio", "grpo_dis", "running_mean"):
        v, _, returns = critic_targets(batch, state_values, AlgorithmConfig(name=name))
        assert torch.equal(returns, sao.returns) and torch.equal(v, sao.old_values)
