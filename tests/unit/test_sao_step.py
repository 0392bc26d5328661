"""`sao_step`, the algorithm in one function: what it asks of the engines, in which order, with which
fields. The engines are recording fakes (the boundary); the targets and the loss closures are real."""

import pytest
import torch

from megatron_sao.config import AlgorithmConfig
from megatron_sao.megatron.engine import StepResult
from megatron_sao.trainer.losses import critic_loss_fn, policy_loss_fn
from megatron_sao.trainer.step import sao_step
from megatron_sao.trainer.targets import compute_targets
from megatron_sao.trajectory import TrajectoryBuilder, collate_padded


def _traj(pid, reward, versions=(3, 3)):
    b = TrajectoryBuilder(prompt_id=pid)
    b.add_prompt([1, 2])
    b.add_action([3, 4], [-0.1, -0.2], versions[0])
    b.add_observation([5])
    b.add_action([6], [-0.3], versions[1])
    return b.finish("terminated", reward=reward)


class FakeEngine:
    """Records every call; `train_step` runs the real loss closure on a made-up model output."""

    def __init__(self, name, calls, offset=0.0, skip=False):
        self.name, self.calls, self.offset, self.skip = name, calls, offset, skip
        self.seen = []

    def values(self, fields):
        self.calls.append(f"{self.name}.values")
        b, t = fields["tokens"].shape
        return torch.arange(b * t, dtype=torch.float32).reshape(b, t) / (b * t)

    def train_step(self, fields, loss_fn):
        self.calls.append(f"{self.name}.train_step")
        self.seen.append({k: v.clone() for k, v in fields.items()})
        mask = fields["action_mask"].bool()
        if self.name == "actor":  # log-probs `offset` away from the sampler's on every action token
            output = (fields["rollout_logprobs"] + self.offset).requires_grad_()
        else:
            output = torch.zeros_like(fields["tokens"], dtype=torch.float32).requires_grad_()
        loss, metrics = loss_fn(output, fields, mask.sum())
        metrics = {k: float(v) for k, v in metrics.items()}
        return StepResult(float(loss.detach()), 1.0, metrics, skipped=self.skip)


def _engines(calls, **actor_kw):
    return FakeEngine("actor", calls, **actor_kw), FakeEngine("critic", calls)


def test_sao_step_runs_values_targets_k_critic_steps_then_one_actor_step():
    algo = AlgorithmConfig(critic_steps=2)
    batch = collate_padded([_traj("a", 1.0), _traj("b", 0.0, versions=(2, 3))])
    calls = []
    actor, critic = _engines(calls, offset=-0.25)
    out = sao_step(batch, actor, critic, algo, policy_loss=policy_loss_fn(algo), critic_loss=critic_loss_fn(),
                   version=3, train_actor=True)
    assert calls == ["critic.values", "critic.train_step", "critic.train_step", "actor.train_step"]
    expected = compute_targets(batch, critic.values({"tokens": batch.tokens}), algo)
    for fields in critic.seen:  # both critic steps train on the same, fixed returns
        assert torch.equal(fields["returns"], expected.returns)
    (a,) = actor.seen
    assert torch.equal(a["advantages"], expected.advantages)
    # Lag 0 = action tokens sampled by version 3, the weights about to be trained; row b's first
    # action came from version 2.
    assert torch.equal(a["lag0_mask"], batch.action_mask & (batch.versions == 3))
    assert int(a["lag0_mask"].sum()) == 4 and int(batch.action_mask.sum()) == 6
    assert out.actor_updated
    assert out.metrics["logprob_mismatch_lag0"] == pytest.approx(0.25)
    assert "actor/kept_fraction" in out.metrics and "actor/grad_norm" in out.metrics
    assert "critic/grad_norm" in out.metrics and "critic/explained_variance" in out.metrics
    assert out.metrics["policy_lambda_mean"] == pytest.approx(float(expected.metrics["policy_lambda_mean"]))


def test_during_the_critic_warm_up_only_the_critic_trains():
    algo = AlgorithmConfig(critic_steps=2)
    calls = []
    actor, critic = _engines(calls)
    out = sao_step(collate_padded([_traj("a", 1.0)]), actor, critic, algo, policy_loss=policy_loss_fn(algo),
                   critic_loss=critic_loss_fn(), version=0, train_actor=False)
    assert calls == ["critic.values", "critic.train_step", "critic.train_step"]
    assert not out.actor_updated and not any(k.startswith("actor/") for k in out.metrics)


def test_a_skipped_actor_step_is_no_new_policy_version():
    algo = AlgorithmConfig()
    actor, critic = _engines([], skip=True)
    out = sao_step(collate_padded([_traj("a", 1.0)]), actor, critic, algo, policy_loss=policy_loss_fn(algo),
                   critic_loss=critic_loss_fn(), version=0, train_actor=True)
    assert not out.actor_updated


def test_a_check_that_stops_the_run_stops_it_before_the_next_optimizer_step():
    """The trainer's non-finite policy saves and raises from `check`: no further step may run first,
    or the checkpoint would miss it."""
    algo = AlgorithmConfig(critic_steps=2)
    calls, checked = [], []

    def check(result, role):
        checked.append(role)
        raise RuntimeError("stop")

    actor, critic = _engines(calls)
    with pytest.raises(RuntimeError, match="stop"):
        sao_step(collate_padded([_traj("a", 1.0)]), actor, critic, algo, policy_loss=policy_loss_fn(algo),
                 critic_loss=critic_loss_fn(), version=0, train_actor=True, check=check)
    assert calls == ["critic.values", "critic.train_step"] and checked == ["critic"]


def test_critic_free_baselines_run_the_same_step_without_a_critic():
    algo = AlgorithmConfig(name="grpo", group_size=2)
    batch = collate_padded([_traj("a", 1.0), _traj("a", 0.0)])
    calls = []
    actor = FakeEngine("actor", calls)
    out = sao_step(batch, actor, None, algo, policy_loss=policy_loss_fn(algo), critic_loss=critic_loss_fn(),
                   version=3, train_actor=True)
    assert calls == ["actor.train_step"] and "returns" not in actor.seen[0]
    adv = actor.seen[0]["advantages"]
    assert (adv[0][batch.action_mask[0]] > 0).all() and (adv[1][batch.action_mask[1]] < 0).all()
    assert out.actor_updated and "actor/clip_fraction" in out.metrics and "critic/loss" not in out.metrics
