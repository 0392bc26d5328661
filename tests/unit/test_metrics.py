"""Tests for masked statistics, diagnostics metrics and the critic-free baselines."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_sao.algorithms.baselines import RunningMeanBaseline, broadcast_to_tokens, grpo_advantages
from megatron_sao.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from megatron_sao.algorithms.metrics import (
    explained_variance,
    logprob_mismatch,
    masked_max,
    version_lag_histogram,
)

torch.set_num_threads(1)
F64 = torch.float64


# ---------------------------------------------------------------- masked statistics


def test_masked_stats_hand_values_and_nan_off_mask():
    x = torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("inf"), 6.0]], dtype=F64)
    mask = torch.tensor([[True, True, False], [True, False, True]])
    assert masked_sum(x, mask).item() == 12.0
    assert masked_mean(x, mask).item() == 3.0
    assert masked_var(x, mask).item() == pytest.approx((4 + 1 + 0 + 9) / 4)
    assert masked_var(x, mask, unbiased=True).item() == pytest.approx(14 / 3)
    assert masked_mean(x, mask, dim=1).tolist() == [1.5, 4.5]
    assert masked_var(x, mask, dim=1).tolist() == [0.25, 2.25]
    assert masked_max(x, mask).item() == 6.0


def test_masked_stats_empty_mask_is_zero():
    x = torch.randn(2, 3, dtype=F64)
    empty = torch.zeros(2, 3, dtype=torch.bool)
    assert masked_mean(x, empty).item() == 0.0 and masked_var(x, empty).item() == 0.0
    assert masked_max(x, empty).item() == 0.0
    assert torch.all(masked_whiten(x, empty) == 0)


def test_masked_whiten():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 9, generator=gen, dtype=F64) * 3 + 2
    mask = torch.rand(4, 9, generator=gen) < 0.6
    w = masked_whiten(x, mask)
    assert masked_mean(w, mask).item() == pytest.approx(0.0, abs=1e-12)
    assert masked_var(w, mask).item() == pytest.approx(1.0, abs=1e-6)
    assert torch.all(w[~mask] == 0)
    kept_mean = masked_whiten(x, mask, shift_mean=False)
    assert masked_mean(kept_mean, mask).item() == pytest.approx(masked_mean(x, mask).item(), abs=1e-12)
    with pytest.raises(TypeError, match="mask must be a torch.bool"):
        masked_whiten(x, mask.double())


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(-1e3, 1e3), st.booleans()), min_size=1, max_size=30))
def test_masked_mean_var_property(pairs):
    x = torch.tensor([[v for v, _ in pairs]], dtype=F64)
    mask = torch.tensor([[m for _, m in pairs]])
    selected = x[mask]
    if selected.numel() == 0:
        assert masked_mean(x, mask).item() == 0.0
        return
    assert masked_mean(x, mask).item() == pytest.approx(selected.mean().item(), abs=1e-9)
    assert masked_var(x, mask).item() == pytest.approx(selected.var(unbiased=False).item(), rel=1e-9, abs=1e-6)


# ---------------------------------------------------------------- metrics


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0, 99.0]], dtype=F64)
    mask = torch.tensor([[True, True, True, True, False]])
    assert explained_variance(returns, returns, mask).item() == 1.0
    mean_pred = torch.full_like(returns, 2.5)
    assert explained_variance(mean_pred, returns, mask).item() == pytest.approx(0.0, abs=1e-12)
    noisy = returns + torch.tensor([[0.5, -0.5, 0.5, -0.5, 0.0]], dtype=F64)
    assert explained_variance(noisy, returns, mask).item() == pytest.approx(1 - 0.25 / 1.25)
    assert math.isnan(explained_variance(returns, torch.ones_like(returns), mask).item())


def test_logprob_mismatch():
    train = torch.tensor([[-1.0, -2.0, -3.0]], dtype=F64)
    rollout = torch.tensor([[-1.5, -1.0, 50.0]], dtype=F64)
    mask = torch.tensor([[True, True, False]])
    assert logprob_mismatch(train, rollout, mask).item() == pytest.approx(0.75)


def test_version_lag_histogram():
    versions = torch.tensor([[5, 5, -1, 3], [4, -1, -1, 5]], dtype=torch.int32)
    mask = torch.tensor([[True, True, False, True], [True, False, False, True]])
    assert version_lag_histogram(versions, mask, current_version=5) == {0: 3, 1: 1, 2: 1}
    assert version_lag_histogram(versions, torch.zeros_like(mask), 5) == {}
    with pytest.raises(ValueError, match="exceed current_version 4"):
        version_lag_histogram(versions, mask, current_version=4)
    with pytest.raises(ValueError, match="unset version"):
        version_lag_histogram(versions, torch.ones_like(mask), current_version=5)


# ---------------------------------------------------------------- baselines


def test_grpo_advantages_hand_values():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 5.0, 2.0, 2.0], dtype=F64)
    groups = torch.tensor([7, 7, 3, 3, 9, 1, 1])
    adv = grpo_advantages(rewards, groups, eps=0.0)
    s = math.sqrt(0.5)  # unbiased std of {0, 1}
    expected = [0.5 / s, -0.5 / s, 0.5 / s, -0.5 / s, 0.0, 0.0, 0.0]  # singleton -> 0; equal -> 0
    assert (adv - torch.tensor(expected, dtype=F64)).abs().max().item() < 1e-12
    centred = grpo_advantages(rewards, groups, normalize_std=False)
    assert centred.tolist() == [0.5, -0.5, 0.5, -0.5, 0.0, 0.0, 0.0]
    with pytest.raises(TypeError, match="group_ids must be an integer"):
        grpo_advantages(rewards, groups.double())
    with pytest.raises(ValueError, match="group_ids must have shape"):
        grpo_advantages(rewards, groups[:3])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.floats(-10, 10)), min_size=1, max_size=24))
def test_grpo_property_zero_mean_per_group(pairs):
    groups = torch.tensor([g for g, _ in pairs])
    rewards = torch.tensor([r for _, r in pairs], dtype=F64)
    adv = grpo_advantages(rewards, groups)
    for g in groups.unique():
        sel = adv[groups == g]
        assert abs(sel.sum().item()) < 1e-6 * max(1.0, sel.abs().max().item())
        if sel.numel() > 1 and rewards[groups == g].std().item() > 1e-3:
            assert sel.std().item() == pytest.approx(1.0, rel=1e-3)


def test_broadcast_to_tokens():
    mask = torch.tensor([[True, False, True], [False, False, False]])
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask)
    assert out.tolist() == [[2.0, 0.0, 2.0], [0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="action_mask must have shape"):
        broadcast_to_tokens(torch.tensor([1.0]), mask)


def test_running_mean_baseline_window_and_round_trip():
    base = RunningMeanBaseline(window=3)
    first = base.advantages(torch.tensor([1.0, 2.0]))
    assert first.tolist() == [1.0, 2.0]  # no history: baseline = initial = 0
    base.update(torch.tensor([1.0, 2.0]))
    base.update(torch.tensor([3.0, 7.0]))  # window keeps [2, 3, 7]
    assert base.value == pytest.approx(4.0) and len(base) == 3
    assert base.advantages(torch.tensor([4.0, 0.0])).tolist() == [0.0, -4.0]
    restored = RunningMeanBaseline(window=3, initial=99.0)
    restored.load_state_dict(base.state_dict())
    assert restored.value == base.value and restored.state_dict() == base.state_dict()
    restored.update(torch.tensor([10.0]))
    base.update(torch.tensor([10.0]))
    assert restored.value == base.value == pytest.approx(20 / 3)
    with pytest.raises(ValueError, match="window 5 does not match"):
        RunningMeanBaseline(window=3).load_state_dict({"window": 5, "initial": 0.0, "history": []})
    with pytest.raises(ValueError, match="window must be >= 1"):
        RunningMeanBaseline(window=0)
    with pytest.raises(ValueError, match="finite"):
        base.update(torch.tensor([float("nan")]))


def test_explained_variance_is_nan_when_returns_vary_only_by_rounding():
    # All rewards 0: float32 returns R = A + V land near 1e-7 instead of exactly 0.
    torch.manual_seed(0)
    values = 0.5 + 0.01 * torch.randn(4, 16)
    returns = 1e-7 * torch.randn(4, 16)
    mask = torch.ones(4, 16, dtype=torch.bool)
    assert torch.isnan(explained_variance(values, returns, mask))
    # a real spread of returns still gives a number
    assert torch.isfinite(explained_variance(values, values + 0.1 * torch.randn(4, 16), mask))


def test_critic_fit_reports_level_error_and_ev_per_turn():
    from megatron_sao.algorithms import critic_fit

    returns = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, False]])
    turns = torch.tensor([[0, 0, 1, -1], [0, 0, 1, -1]])
    # Right in turn 1 (the state there says how the episode ends), a constant 0.5 in turn 0.
    values = torch.tensor([[0.5, 0.5, 1.0, 9.0], [0.5, 0.5, 0.0, 9.0]])
    fit = critic_fit(values, returns, mask, turns)
    assert fit["ev_turn_1"] == pytest.approx(1.0) and fit["ev_turn_0"] == pytest.approx(0.0)
    assert fit["value_mean"] == pytest.approx(0.5) and fit["return_mean"] == pytest.approx(0.5)
    assert fit["value_mse"] == pytest.approx(4 * 0.25 / 6)  # the padding's 9.0 is not counted
    assert fit["explained_variance"] == pytest.approx(1 - (4 * 0.25 / 6) / 0.25)
    assert "ev_turn_2" not in fit
