"""Tests for the DIS policy loss, the PPO clip loss and the value loss."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_sao.algorithms.losses import dis_policy_loss, entropy_bonus, ppo_clip_loss, value_loss

torch.set_num_threads(1)
F64 = torch.float64


def assert_close(actual, expected, atol=1e-12, rtol=0.0):
    """Like torch.testing.assert_close (whose first call imports torch.distributed.tensor: seconds)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual, expected)
    err = (actual - expected).abs()
    bound = atol + rtol * expected.abs()
    assert bool((err <= bound).all()), f"max |diff| {err.max().item():.3e} exceeds tolerance:\n{actual}\n{expected}"
EPS_LOW, EPS_HIGH = 0.3, 5.0  # band (0.7, 6.0)


def edge_batch():
    """Row of ratios at and just inside both band edges, plus a masked-out and a non-action token.

    logprobs = rollout + log(r) in float64. With these rollout values exp(logprobs - rollout)
    reproduces 0.7 and 6.0 exactly (checked below rather than assumed), so the strict band excludes
    them; 0.7001 and 5.999 come back within one ulp and are kept.
    """
    ratios = torch.tensor([0.7, 0.7001, 5.999, 6.0, 1.0, 2.0], dtype=F64)
    rollout = torch.tensor([-1.3, -0.5, -2.0, 0.0, -0.7, -3.0], dtype=F64)
    logprobs = rollout + torch.log(ratios)
    advantages = torch.tensor([1.0, -2.0, 0.5, 3.0, 4.0, 5.0], dtype=F64)
    mask = torch.tensor([True, True, True, True, True, False])
    return logprobs.unsqueeze(0), rollout.unsqueeze(0), advantages.unsqueeze(0), mask.unsqueeze(0)


def test_dis_band_edges_values_and_gradients():
    logprobs, rollout, adv, mask = edge_batch()
    computed = torch.exp(logprobs - rollout)
    assert computed[0, 0].item() == 0.7 and computed[0, 3].item() == 6.0  # the edges land exactly
    lp = logprobs.clone().requires_grad_(True)
    loss, metrics = dis_policy_loss(lp, rollout, adv, mask, EPS_LOW, EPS_HIGH)
    loss.backward()

    kept = torch.tensor([[False, True, True, False, True, False]])
    n = 5  # action tokens, the two dropped at the edges included
    expected_loss = -(computed * adv)[kept].sum() / n
    assert loss.item() == pytest.approx(expected_loss.item(), abs=1e-14)
    expected_grad = torch.where(kept, -computed * adv / n, torch.zeros((), dtype=F64))
    assert_close(lp.grad, expected_grad, atol=1e-15, rtol=0)
    assert torch.all(lp.grad[~kept] == 0)  # exactly zero outside the band and off the mask

    assert metrics["kept_count"].item() == 3 and metrics["action_count"].item() == 5
    assert metrics["below_count"].item() == 1 and metrics["above_count"].item() == 1
    assert metrics["kept_fraction"].item() == pytest.approx(0.6)
    assert metrics["below_fraction"].item() == pytest.approx(0.2)
    assert metrics["above_fraction"].item() == pytest.approx(0.2)
    action_ratios = computed[mask]
    assert metrics["ratio_mean"].item() == pytest.approx(action_ratios.mean().item())
    assert metrics["ratio_max"].item() == pytest.approx(6.0)
    ess = action_ratios.sum() ** 2 / (5 * (action_ratios**2).sum())
    assert metrics["ess"].item() == pytest.approx(ess.item(), rel=1e-12)
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


@pytest.mark.parametrize("eps_low, eps_high", [(0.3, 5.0), (0.8, 3.0)])
def test_dis_keep_rule_matches_float_comparison(eps_low, eps_high):
    """Whatever rounding does near the edges, kept == (lo < r < hi) on the computed ratio."""
    gen = torch.Generator().manual_seed(0)
    edges = torch.tensor([1 - eps_low, 1 + eps_high], dtype=F64)
    ratios = (edges.repeat_interleave(50) * (1 + torch.randn(100, generator=gen, dtype=F64) * 1e-15)).unsqueeze(0)
    rollout = -torch.rand(1, 100, generator=gen, dtype=F64) * 5
    logprobs = (rollout + torch.log(ratios)).requires_grad_(True)
    adv = torch.ones(1, 100, dtype=F64)
    mask = torch.ones(1, 100, dtype=torch.bool)
    loss, metrics = dis_policy_loss(logprobs, rollout, adv, mask, eps_low, eps_high)
    loss.backward()
    r = torch.exp(logprobs.detach() - rollout)
    kept = (r > 1 - eps_low) & (r < 1 + eps_high)
    assert 0 < kept.sum().item() < 100  # the jitter put ratios on both sides of the edges
    assert metrics["kept_count"].item() == kept.sum().item()
    assert torch.equal(logprobs.grad != 0, kept)


def test_dis_huge_ratio_gives_zero_grad_no_nan():
    rollout = torch.tensor([[-100.0, -1.0, 0.0]], dtype=F64)
    logprobs = torch.tensor([[0.0, -1.0, -200.0]], dtype=F64, requires_grad=True)  # r = e^100, 1, e^-200
    adv = torch.tensor([[2.0, 3.0, 4.0]], dtype=F64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, metrics = dis_policy_loss(logprobs, rollout, adv, mask, EPS_LOW, EPS_HIGH)
    loss.backward()
    assert loss.item() == pytest.approx(-3.0 / 3)
    assert logprobs.grad.tolist() == [[0.0, -1.0, 0.0]]
    assert metrics["ratio_max"].item() == pytest.approx(math.exp(100), rel=1e-12)
    assert math.isfinite(metrics["ess"].item()) and metrics["ess"].item() == pytest.approx(1 / 3, rel=1e-9)
    # float32: e^100 overflows; the loss and gradient stay finite all the same.
    lp32 = logprobs.detach().float().requires_grad_(True)
    loss32, _ = dis_policy_loss(lp32, rollout.float(), adv.float(), mask, EPS_LOW, EPS_HIGH)
    loss32.backward()
    assert torch.isfinite(lp32.grad).all() and lp32.grad.tolist() == [[0.0, -1.0, 0.0]]


def test_dis_nan_off_mask_does_not_leak():
    logprobs = torch.tensor([[float("nan"), -1.0, float("-inf")]], dtype=F64, requires_grad=True)
    rollout = torch.tensor([[0.0, -1.2, 0.0]], dtype=F64)
    adv = torch.tensor([[float("nan"), 1.0, 1.0]], dtype=F64)
    mask = torch.tensor([[False, True, False]])
    loss, _ = dis_policy_loss(logprobs, rollout, adv, mask, EPS_LOW, EPS_HIGH)
    loss.backward()
    assert torch.isfinite(loss) and logprobs.grad[0, 0].item() == 0.0 and logprobs.grad[0, 2].item() == 0.0


def test_dis_loss_denominator_splits_exactly():
    """Two micro-batches with the global count as denominator sum to the full-batch loss and grad."""
    gen = torch.Generator().manual_seed(1)
    logprobs = -torch.rand(4, 10, generator=gen, dtype=F64)
    rollout = logprobs + torch.randn(4, 10, generator=gen, dtype=F64) * 0.3
    adv = torch.randn(4, 10, generator=gen, dtype=F64)
    mask = torch.rand(4, 10, generator=gen) < 0.6
    full_lp = logprobs.clone().requires_grad_(True)
    full, full_m = dis_policy_loss(full_lp, rollout, adv, mask, EPS_LOW, EPS_HIGH)
    full.backward()
    total = mask.sum()
    split_lp = logprobs.clone().requires_grad_(True)
    parts = [dis_policy_loss(split_lp[s], rollout[s], adv[s], mask[s], EPS_LOW, EPS_HIGH, loss_denominator=total)
             for s in (slice(0, 1), slice(1, 4))]
    sum(p[0] for p in parts).backward()
    assert sum(p[0] for p in parts).item() == pytest.approx(full.item(), abs=1e-14)
    assert_close(split_lp.grad, full_lp.grad, atol=1e-15, rtol=0)
    for key in ("kept_count", "action_count", "ratio_sum", "ratio_sq_sum"):
        assert sum(p[1][key] for p in parts).item() == pytest.approx(full_m[key].item(), rel=1e-12)
    assert dis_policy_loss(split_lp, rollout, adv, mask, EPS_LOW, EPS_HIGH, loss_denominator=float(total))[0].item() \
        == pytest.approx(full.item(), abs=1e-14)


def test_dis_empty_batch_and_errors():
    lp = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    loss, metrics = dis_policy_loss(lp, lp.detach(), lp.detach(), mask, EPS_LOW, EPS_HIGH)
    loss.backward()
    assert loss.item() == 0.0 and torch.all(lp.grad == 0)
    assert all(v.item() == 0 for v in metrics.values())
    with pytest.raises(ValueError, match="eps_low"):
        dis_policy_loss(lp, lp, lp, mask, 1.5, 5.0)
    with pytest.raises(ValueError, match="eps_high"):
        dis_policy_loss(lp, lp, lp, mask, 0.3, 0.0)
    with pytest.raises(ValueError, match="advantages must have the same shape"):
        dis_policy_loss(lp, lp, torch.zeros(2, 4, dtype=F64), mask, 0.3, 5.0)
    with pytest.raises(ValueError, match="loss_denominator"):
        dis_policy_loss(lp, lp, lp, mask, 0.3, 5.0, loss_denominator=torch.tensor(-1.0))


@settings(max_examples=40, deadline=None)
@given(
    log_ratios=st.lists(st.floats(-5, 5), min_size=1, max_size=16),
    seed=st.integers(0, 1000),
)
def test_dis_property_grad_formula(log_ratios, seed):
    gen = torch.Generator().manual_seed(seed)
    n = len(log_ratios)
    rollout = -torch.rand(1, n, generator=gen, dtype=F64)
    lp = (rollout + torch.tensor([log_ratios], dtype=F64)).requires_grad_(True)
    adv = torch.randn(1, n, generator=gen, dtype=F64)
    mask = torch.rand(1, n, generator=gen) < 0.8
    loss, m = dis_policy_loss(lp, rollout, adv, mask, EPS_LOW, EPS_HIGH)
    loss.backward()
    r = torch.exp(lp.detach() - rollout)
    kept = mask & (r > 0.7) & (r < 6.0)
    expected = torch.where(kept, -r * adv / max(int(mask.sum()), 1), torch.zeros((), dtype=F64))
    assert_close(lp.grad, expected, atol=1e-14, rtol=1e-12)
    assert m["kept_count"] + m["below_count"] + m["above_count"] == m["action_count"]
    assert 0.0 <= m["ess"].item() <= 1.0 + 1e-12


# ---------------------------------------------------------------- PPO clip loss


def test_ppo_clip_loss_hand_computation():
    ratios = torch.tensor([[0.5, 0.9, 1.1, 1.5, 1.5, 0.5, 1.0]], dtype=F64)
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0, -1.0, -1.0, 7.0]], dtype=F64)
    mask = torch.tensor([[True, True, True, True, True, True, False]])
    old = torch.full((1, 7), -1.0, dtype=F64)
    lp = (old + torch.log(ratios)).requires_grad_(True)
    loss, m = ppo_clip_loss(lp, old, adv, mask, 0.2, 0.2)
    loss.backward()
    # token: max(-A r, -A clip(r, .8, 1.2))
    #   r=.5,A=1  -> max(-.5, -.8) = -.5  (unclipped, grad -A r = -.5)
    #   r=.9,A=1  -> -.9                  (inside, grad -.9)
    #   r=1.1,A=-1 -> 1.1                 (inside, grad 1.1)
    #   r=1.5,A=1 -> max(-1.5, -1.2) = -1.2 (clipped, grad 0)
    #   r=1.5,A=-1 -> max(1.5, 1.2) = 1.5 (unclipped, grad 1.5)
    #   r=.5,A=-1 -> max(.5, .8) = .8     (clipped, grad 0)
    per = [-0.5, -0.9, 1.1, -1.2, 1.5, 0.8]
    assert loss.item() == pytest.approx(sum(per) / 6, abs=1e-14)
    expected_grad = torch.tensor([[-0.5, -0.9, 1.1, 0.0, 1.5, 0.0, 0.0]], dtype=F64) / 6
    assert_close(lp.grad, expected_grad, atol=1e-14, rtol=0)
    assert m["clip_count"].item() == 2 and m["clip_fraction"].item() == pytest.approx(2 / 6)
    k3 = (ratios[mask] - 1 - torch.log(ratios[mask])).mean()
    assert m["approx_kl"].item() == pytest.approx(k3.item(), rel=1e-12)


def test_ppo_matches_textbook_maximum_form():
    gen = torch.Generator().manual_seed(2)
    old = -torch.rand(3, 12, generator=gen, dtype=F64)
    lp_data = old + torch.randn(3, 12, generator=gen, dtype=F64) * 0.4
    adv = torch.randn(3, 12, generator=gen, dtype=F64)
    mask = torch.rand(3, 12, generator=gen) < 0.7
    lp = lp_data.clone().requires_grad_(True)
    loss, _ = ppo_clip_loss(lp, old, adv, mask, 0.2, 0.28)
    loss.backward()
    lp2 = lp_data.clone().requires_grad_(True)
    r = torch.exp(lp2 - old)
    per = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.28))
    ref = (per * mask).sum() / mask.sum()
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), abs=1e-14)
    assert_close(lp.grad, lp2.grad, atol=1e-14, rtol=0)


def test_ppo_overflowing_clipped_ratio_has_zero_grad():
    lp = torch.tensor([[0.0]], requires_grad=True)
    loss, _ = ppo_clip_loss(lp, torch.tensor([[-200.0]]), torch.tensor([[1.0]]), torch.ones(1, 1, dtype=torch.bool),
                            0.2, 0.2)
    loss.backward()
    assert loss.item() == pytest.approx(-1.2) and lp.grad.item() == 0.0


# ---------------------------------------------------------------- value loss


def test_value_loss_plain_and_denominator():
    values = torch.tensor([[1.0, 2.0, float("nan")]], dtype=F64, requires_grad=True)
    returns = torch.tensor([[0.0, 4.0, 1.0]], dtype=F64)
    mask = torch.tensor([[True, True, False]])
    loss, m = value_loss(values, returns, mask)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * (1 + 4) / 2)
    assert values.grad.tolist() == [[0.5, -1.0, 0.0]]  # (V - R) / n, zero (not NaN) off the mask
    assert m["action_count"].item() == 2 and m["value_mean"].item() == pytest.approx(1.5)
    assert m["sq_error_sum"].item() == pytest.approx(5.0)
    half, _ = value_loss(values, returns, mask, loss_denominator=4)
    assert half.item() == pytest.approx(loss.item() / 2)


def test_value_loss_clipped():
    old = torch.tensor([[0.0, 0.0, 0.0]], dtype=F64)
    values = torch.tensor([[1.0, 0.1, -1.0]], dtype=F64, requires_grad=True)
    returns = torch.tensor([[0.0, 1.0, -2.0]], dtype=F64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, m = value_loss(values, returns, mask, old_values=old, clip=0.2)
    loss.backward()
    # token 0: unclipped (1-0)^2=1, clipped (0.2-0)^2=.04 -> 1, grad (V-R)=1
    # token 1: |0.1| < 0.2, both .81 -> .81, grad -0.9
    # token 2: unclipped (-1+2)^2=1, clipped (-0.2+2)^2=3.24 -> 3.24, clipped: grad 0
    assert loss.item() == pytest.approx(0.5 * (1 + 0.81 + 3.24) / 3)
    assert_close(values.grad, torch.tensor([[1.0, -0.9, 0.0]], dtype=F64) / 3, atol=1e-14, rtol=0)
    assert m["clip_count"].item() == 1
    with pytest.raises(ValueError, match="clip requires old_values"):
        value_loss(values, returns, mask, clip=0.2)
    with pytest.raises(ValueError, match="clip"):
        value_loss(values, returns, mask, old_values=old, clip=-1.0)


def test_entropy_bonus_is_minus_coef_times_the_masked_token_mean_and_refuses_bad_input():

    mask = torch.tensor([[False, True, True], [True, False, False]])
    entropy = torch.tensor([[9.0, 1.0, 2.0], [3.0, 7.0, float("nan")]], requires_grad=True)  # NaN off the mask
    loss = entropy_bonus(entropy, mask, 0.1)
    assert float(loss) == pytest.approx(-0.1 * 6.0 / 3)  # local token mean over the 3 action tokens
    loss.backward()
    assert torch.equal(entropy.grad, torch.where(mask, -0.1 / 3, 0.0))  # the masked NaN gets gradient 0
    global_loss = entropy_bonus(entropy.detach(), mask, 0.1, loss_denominator=torch.tensor(12.0))
    assert float(global_loss) == pytest.approx(-0.1 * 6.0 / 12)
    empty = entropy_bonus(entropy.detach(), torch.zeros_like(mask), 0.1)
    assert float(empty) == 0.0
    with pytest.raises(ValueError, match="coef"):
        entropy_bonus(entropy.detach(), mask, -0.1)
    with pytest.raises(ValueError, match="action_mask"):
        entropy_bonus(entropy.detach(), mask[:, :2], 0.1)
