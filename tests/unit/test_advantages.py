"""Tests for skip-observation GAE, adaptive lambda, step-level GAE and the reverse scan."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_sao.algorithms.advantages import adaptive_lambda, skip_observation_gae, step_level_gae
from megatron_sao.algorithms.scan import discounted_cumsum

torch.set_num_threads(1)
F64 = torch.float64


def assert_close(actual, expected, atol=1e-12, rtol=0.0):
    """Like torch.testing.assert_close (whose first call imports torch.distributed.tensor: seconds)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual, expected)
    err = (actual - expected).abs()
    bound = atol + rtol * expected.abs()
    assert bool((err <= bound).all()), f"max |diff| {err.max().item():.3e} exceeds tolerance:\n{actual}\n{expected}"


# ---------------------------------------------------------------- plain per-token references


def reference_gae(rewards, values, mask, gamma, lam, bootstrap=None):
    """Per-token Python loop over the action tokens of each row (the definition, literally)."""
    batch, length = rewards.shape
    adv = torch.zeros(batch, length, dtype=F64)
    ret = torch.zeros(batch, length, dtype=F64)
    for b in range(batch):
        lam_b = float(lam[b]) if isinstance(lam, torch.Tensor) else lam
        idx = [t for t in range(length) if mask[b, t]]
        next_adv = 0.0
        next_value = 0.0 if bootstrap is None else float(bootstrap[b])
        for t in reversed(idx):
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            next_adv = delta + gamma * lam_b * next_adv
            adv[b, t] = next_adv
            ret[b, t] = next_adv + float(values[b, t])
            next_value = float(values[b, t])
    return adv, ret


def reference_step_gae(rewards, values, mask, turn_ids, gamma, lam, mode, bootstrap=None):
    batch, length = rewards.shape
    adv = torch.zeros(batch, length, dtype=F64)
    ret = torch.zeros(batch, length, dtype=F64)
    for b in range(batch):
        turns = {}
        for t in range(length):
            if mask[b, t]:
                turns.setdefault(int(turn_ids[b, t]), []).append(t)
        n = len(turns)
        step_r = [sum(float(rewards[b, t]) for t in turns[k]) for k in range(n)]
        if mode == "turn_avg":
            step_v = [sum(float(values[b, t]) for t in turns[k]) / len(turns[k]) for k in range(n)]
        else:
            step_v = [float(values[b, turns[k][-1]]) for k in range(n)]
        next_adv, next_value = 0.0, (0.0 if bootstrap is None else float(bootstrap[b]))
        for k in reversed(range(n)):
            next_adv = step_r[k] + gamma * next_value - step_v[k] + gamma * lam * next_adv
            for t in turns[k]:
                adv[b, t] = next_adv
                ret[b, t] = next_adv + step_v[k]
            next_value = step_v[k]
    return adv, ret


def random_episode(gen, batch, length, max_turns=4):
    """Rows of prompt, then alternating action / observation segments, then padding.

    Rewards sit on action tokens only (mostly on the last one, sometimes dense); turn_ids number
    the action segments. Some rows get no action at all.
    """
    mask = torch.zeros(batch, length, dtype=torch.bool)
    turn_ids = torch.full((batch, length), -1, dtype=torch.long)
    for b in range(batch):
        t = int(torch.randint(0, 4, (1,), generator=gen))
        n_turns = int(torch.randint(0, max_turns + 1, (1,), generator=gen))
        for k in range(n_turns):
            span = int(torch.randint(1, 6, (1,), generator=gen))
            if t + span > length:
                break
            mask[b, t : t + span] = True
            turn_ids[b, t : t + span] = k
            t += span + int(torch.randint(0, 4, (1,), generator=gen))
    rewards = torch.randn(batch, length, generator=gen, dtype=F64) * (torch.rand(batch, length, generator=gen) < 0.3)
    rewards = torch.where(mask, rewards, torch.zeros((), dtype=F64))
    values = torch.randn(batch, length, generator=gen, dtype=F64)
    return rewards, values, mask, turn_ids


# ---------------------------------------------------------------- skip-observation GAE


@pytest.mark.parametrize("seed", range(20))
def test_gae_matches_reference_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    rewards, values, mask, _ = random_episode(gen, batch=6, length=int(torch.randint(1, 40, (1,), generator=gen)))
    gamma = [1.0, 0.99, 0.9, 0.5][seed % 4]
    lam = torch.rand(6, generator=gen, dtype=F64) if seed % 2 else 0.95
    bootstrap = torch.randn(6, generator=gen, dtype=F64) if seed % 3 == 0 else None
    adv, ret = skip_observation_gae(rewards, values, mask, gamma, lam, bootstrap)
    ref_adv, ref_ret = reference_gae(rewards, values, mask, gamma, lam, bootstrap)
    assert_close(adv, ref_adv, atol=1e-10, rtol=0)
    assert_close(ret, ref_ret, atol=1e-10, rtol=0)


def test_gae_verl_multi_turn_case():
    """verl's test_multi_turn_compute_gae_advantage_return, adapted to this API.

    verl's rewards [0,0,.1,.1,.1,0,0,.1,1,0,0] already put every nonzero reward on an action token
    of the mask [0,0,1,1,1,0,0,1,1,0,0], so they are used unchanged (nothing to move or zero).
    Action values are verl's (4, 5, 6, 7, 9); the two value vectors differ only at masked
    positions, where verl draws random numbers (fixed here, and far apart).
    """
    rewards = torch.tensor([[0, 0, 0.1, 0.1, 0.1, 0, 0, 0.1, 1, 0, 0]], dtype=F64)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0]], dtype=torch.bool)
    values1 = torch.tensor([[37.0, 0.25, 4, 5, 6, -80.0, 0.5, 7, 9, 0, 0]], dtype=F64)
    values2 = torch.tensor([[0.75, -12.0, 4, 5, 6, 0.125, 66.0, 7, 9, 0, 0]], dtype=F64)
    for gamma, lam in [(1.0, 1.0), (0.37, 0.81), (0.9, 0.0)]:
        adv1, ret1 = skip_observation_gae(rewards, values1, mask, gamma, lam)
        adv2, ret2 = skip_observation_gae(rewards, values2, mask, gamma, lam)
        assert torch.equal(adv1, adv2) and torch.equal(ret1, ret2)
        ref_adv, ref_ret = reference_gae(rewards, values1, mask, gamma, lam)
        assert_close(adv1, ref_adv)
        assert_close(ret1, ref_ret)
    # gamma = lam = 1: the returns are the rewards-to-go.
    _, ret = skip_observation_gae(rewards, values1, mask, gamma=1.0, lam=1.0)
    assert_close(ret, torch.tensor([[0, 0, 1.4, 1.3, 1.2, 0, 0, 1.1, 1.0, 0, 0]], dtype=F64))
    # The chain jumps from position 4 straight to 7: with lam=0, A_4 = r_4 + V_7 - V_4.
    adv0, _ = skip_observation_gae(rewards, values1, mask, gamma=1.0, lam=0.0)
    assert adv0[0, 4].item() == pytest.approx(0.1 + 7 - 6, abs=1e-12)


def test_gae_ignores_observation_values_even_nan():
    gen = torch.Generator().manual_seed(1)
    rewards, values, mask, _ = random_episode(gen, batch=8, length=30)
    perturbed = torch.where(mask, values, torch.randn(8, 30, generator=gen, dtype=F64) * 100)
    nan_values = torch.where(mask, values, torch.full((), float("nan"), dtype=F64))
    base = skip_observation_gae(rewards, values, mask, 0.97, 0.9)
    for other in (perturbed, nan_values):
        out = skip_observation_gae(rewards, other, mask, 0.97, 0.9)
        assert torch.equal(base[0], out[0]) and torch.equal(base[1], out[1])


def test_gae_inserting_observation_tokens_changes_nothing():
    """Moving action tokens apart (more observation positions between them) leaves A unchanged."""
    gen = torch.Generator().manual_seed(2)
    rewards, values, mask, _ = random_episode(gen, batch=4, length=20)
    wide = torch.zeros(4, 60, dtype=torch.bool)
    wide[:, ::3] = mask
    spread = lambda x: torch.zeros(4, 60, dtype=F64).index_copy_(1, torch.arange(0, 60, 3), x)  # noqa: E731
    adv, ret = skip_observation_gae(rewards, values, mask, 0.9, 0.8)
    wide_adv, wide_ret = skip_observation_gae(spread(rewards), spread(values), wide, 0.9, 0.8)
    assert_close(wide_adv[:, ::3], adv, atol=1e-12, rtol=0)
    assert_close(wide_ret[:, ::3], ret, atol=1e-12, rtol=0)


def test_gae_zero_off_mask_and_empty_rows():
    gen = torch.Generator().manual_seed(3)
    rewards, values, mask, _ = random_episode(gen, batch=5, length=16)
    mask[2] = False
    rewards[2] = 0.0
    adv, ret = skip_observation_gae(rewards, values, mask, 1.0, 1.0, bootstrap_values=torch.ones(5, dtype=F64))
    assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)
    assert torch.all(adv[2] == 0) and torch.all(ret[2] == 0)


def test_empty_shapes():
    for shape in [(0, 5), (3, 0)]:
        zeros = torch.zeros(shape, dtype=F64)
        mask = torch.zeros(shape, dtype=torch.bool)
        adv, ret = skip_observation_gae(zeros, zeros, mask, 1.0, 1.0)
        assert adv.shape == shape and ret.shape == shape
        turn_ids = torch.full(shape, -1)
        adv, ret = step_level_gae(zeros, zeros, mask, turn_ids, 1.0, 1.0)
        assert adv.shape == shape and ret.shape == shape


def test_gae_bootstrap_and_gamma():
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.25, 2.0]], dtype=F64)
    mask = torch.tensor([[True, False, True]])
    adv, ret = skip_observation_gae(rewards, values, mask, gamma=0.5, lam=1.0,
                                    bootstrap_values=torch.tensor([4.0], dtype=F64))
    # last action: delta = 1 + 0.5*4 - 2 = 1; first action: delta = 0 + 0.5*2 - 0.5 = 0.5, A = 0.5 + 0.5*1.
    assert adv.tolist() == [[1.0, 0.0, 1.0]]
    assert ret.tolist() == [[1.5, 0.0, 3.0]]


def test_gae_per_row_lambda_equals_separate_calls():
    gen = torch.Generator().manual_seed(4)
    rewards, values, mask, _ = random_episode(gen, batch=3, length=25)
    lam = torch.tensor([0.0, 0.5, 1.0], dtype=F64)
    adv, _ = skip_observation_gae(rewards, values, mask, 0.99, lam)
    for b in range(3):
        row, _ = skip_observation_gae(rewards[b : b + 1], values[b : b + 1], mask[b : b + 1], 0.99, float(lam[b]))
        assert_close(adv[b : b + 1], row, atol=1e-12, rtol=0)


def test_gae_float32_and_no_grad():
    gen = torch.Generator().manual_seed(5)
    rewards, values, mask, _ = random_episode(gen, batch=4, length=50)
    values32 = values.float().requires_grad_(True)
    adv, ret = skip_observation_gae(rewards.float(), values32, mask, 1.0, 0.95)
    assert adv.dtype == torch.float32 and not adv.requires_grad and not ret.requires_grad
    ref_adv, _ = reference_gae(rewards, values.float().double(), mask, 1.0, 0.95)
    assert_close(adv.double(), ref_adv, atol=1e-5, rtol=1e-5)


def test_gae_rejects_reward_off_mask():
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]], dtype=F64)
    mask = torch.tensor([[True, False, True], [True, True, True]])
    with pytest.raises(ValueError, match=r"1 nonzero value\(s\) outside action_mask \(rows \[0\]\)"):
        skip_observation_gae(rewards, torch.zeros_like(rewards), mask, 1.0, 1.0)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(gamma=1.5), ValueError, "gamma"),
        (dict(lam=-0.1), ValueError, "lam"),
        (dict(lam=torch.tensor([0.5, 2.0], dtype=F64)), ValueError, r"rows \[1\]"),
        (dict(lam=torch.tensor([0.5], dtype=F64)), ValueError, "lam as a tensor"),
        (dict(bootstrap_values=torch.zeros(3, dtype=F64)), ValueError, "bootstrap_values"),
        (dict(action_mask=torch.ones(2, 3)), TypeError, "action_mask must be a torch.bool"),
        (dict(values=torch.zeros(2, 4, dtype=F64)), ValueError, "values must have the same shape"),
        (dict(values=torch.zeros(2, 3)), TypeError, "values dtype"),
    ],
)
def test_gae_input_errors(kwargs, error, match):
    args = dict(
        rewards=torch.zeros(2, 3, dtype=F64), values=torch.zeros(2, 3, dtype=F64),
        action_mask=torch.ones(2, 3, dtype=torch.bool), gamma=1.0, lam=1.0,
    )
    args.update(kwargs)
    with pytest.raises(error, match=match):
        skip_observation_gae(**args)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.lists(st.lists(st.booleans(), min_size=1, max_size=12), min_size=1, max_size=4).filter(
        lambda rows: len({len(r) for r in rows}) == 1
    ),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_gae_property_matches_reference(bits, gamma, lam, seed):
    mask = torch.tensor(bits, dtype=torch.bool)
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(mask.shape, generator=gen, dtype=F64)
    rewards = torch.where(mask, torch.randn(mask.shape, generator=gen, dtype=F64), torch.zeros((), dtype=F64))
    bootstrap = torch.randn(mask.shape[0], generator=gen, dtype=F64)
    adv, ret = skip_observation_gae(rewards, values, mask, gamma, lam, bootstrap)
    ref_adv, ref_ret = reference_gae(rewards, values, mask, gamma, lam, bootstrap)
    assert_close(adv, ref_adv, atol=1e-10, rtol=0)
    assert_close(ret, ref_ret, atol=1e-10, rtol=0)


@pytest.mark.parametrize("length", [0, 1, 2, 3, 15, 16, 17, 255, 256, 257, 8193])
def test_discounted_cumsum_matches_loop(length):
    """Lengths around the block size (16) and its powers exercise the padding and the recursion;
    discount 1e-20 takes the "negligible discount" path, 0 and 1 are the exact extremes."""
    gen = torch.Generator().manual_seed(length)
    x = torch.randn(6, length, generator=gen, dtype=F64)
    d = torch.tensor([0.0, 1e-20, 1e-6, 0.3, 0.9995, 1.0], dtype=F64)
    expected = torch.zeros_like(x)
    acc = torch.zeros(6, dtype=F64)
    for t in range(length):
        acc = x[:, t] + d * acc
        expected[:, t] = acc
    assert_close(discounted_cumsum(x, d), expected, atol=1e-9, rtol=1e-12)
    if length:
        assert torch.equal(discounted_cumsum(x, d)[0], x[0])  # d = 0 is exact


def test_discounted_cumsum_errors_and_dtype():
    with pytest.raises(ValueError, match="discount must lie in"):
        discounted_cumsum(torch.zeros(1, 4), torch.tensor([1.5]))
    with pytest.raises(ValueError, match="discount must have shape"):
        discounted_cumsum(torch.zeros(2, 4), torch.tensor([0.5]))
    y = discounted_cumsum(torch.ones(2, 100), torch.tensor([1.0, 0.5]))
    assert y.dtype == torch.float32
    assert y[0, -1].item() == 100.0 and y[1, -1].item() == pytest.approx(2.0, rel=1e-6)


# ---------------------------------------------------------------- adaptive lambda


def test_adaptive_lambda_values_and_clipping():
    lengths = torch.tensor([0, 1, 2, 3, 100, 10**6])
    lam = adaptive_lambda(lengths, alpha=1.5, dtype=F64)
    expected = [0.0, 1 - 1 / 1.5, 1 - 1 / 3, 1 - 1 / 4.5, 1 - 1 / 150, 1 - 1 / 1.5e6]
    assert_close(lam, torch.tensor(expected, dtype=F64), atol=1e-15, rtol=0)
    clipped = adaptive_lambda(torch.tensor([1, 2, 4]), alpha=0.25, dtype=F64)
    assert clipped.tolist() == [0.0, 0.0, 0.0]  # 1 - 1/(0.25*4) = 0 exactly; smaller l clip up to 0
    assert adaptive_lambda(torch.tensor([5.0]), alpha=1e9).item() == pytest.approx(1.0)
    assert adaptive_lambda(torch.tensor([0]), alpha=1e9).item() == 0.0


def test_adaptive_lambda_errors():
    with pytest.raises(ValueError, match="alpha"):
        adaptive_lambda(torch.tensor([1]), alpha=0.0)
    with pytest.raises(ValueError, match="action_lengths must be >= 0"):
        adaptive_lambda(torch.tensor([-1]), alpha=1.5)
    with pytest.raises(ValueError, match="action_lengths must have shape"):
        adaptive_lambda(torch.tensor([[1]]), alpha=1.5)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10**7), st.floats(1e-3, 1e3))
def test_adaptive_lambda_property(length, alpha):
    lam = adaptive_lambda(torch.tensor([length]), alpha, dtype=F64).item()
    assert 0.0 <= lam <= 1.0
    if length > 0 and alpha * length > 1:
        assert lam == pytest.approx(1 - 1 / (alpha * length), abs=1e-12)
    else:
        assert lam == 0.0


# ---------------------------------------------------------------- step-level GAE


@pytest.mark.parametrize("mode", ["turn_avg", "turn_last"])
@pytest.mark.parametrize("seed", range(6))
def test_step_level_gae_matches_reference(mode, seed):
    gen = torch.Generator().manual_seed(100 + seed)
    rewards, values, mask, turn_ids = random_episode(gen, batch=5, length=30)
    bootstrap = torch.randn(5, generator=gen, dtype=F64) if seed % 2 else None
    gamma, lam = [(1.0, 1.0), (0.9, 0.7)][seed % 2]
    adv, ret = step_level_gae(rewards, values, mask, turn_ids, gamma, lam, mode, bootstrap)
    ref_adv, ref_ret = reference_step_gae(rewards, values, mask, turn_ids, gamma, lam, mode, bootstrap)
    assert_close(adv, ref_adv, atol=1e-10, rtol=0)
    assert_close(ret, ref_ret, atol=1e-10, rtol=0)


def test_step_level_gae_single_token_turns_equal_token_gae():
    """With every turn one token long, both step modes reduce to skip-observation token GAE."""
    gen = torch.Generator().manual_seed(7)
    mask = torch.rand(4, 20, generator=gen) < 0.5
    turn_ids = torch.where(mask, mask.long().cumsum(1) - 1, torch.full((), -1))
    values = torch.randn(4, 20, generator=gen, dtype=F64)
    rewards = torch.where(mask, torch.randn(4, 20, generator=gen, dtype=F64), torch.zeros((), dtype=F64))
    token = skip_observation_gae(rewards, values, mask, 0.95, 0.9)
    for mode in ("turn_avg", "turn_last"):
        step = step_level_gae(rewards, values, mask, turn_ids, 0.95, 0.9, mode)
        assert_close(step[0], token[0], atol=1e-12, rtol=0)


def test_step_level_gae_input_errors():
    rewards = torch.zeros(1, 4, dtype=F64)
    mask = torch.tensor([[True, True, False, True]])
    with pytest.raises(ValueError, match="exactly on action tokens"):
        step_level_gae(rewards, rewards, mask, torch.tensor([[0, 0, 0, 1]]), 1.0, 1.0)
    with pytest.raises(ValueError, match="without gaps"):
        step_level_gae(rewards, rewards, mask, torch.tensor([[0, 0, -1, 2]]), 1.0, 1.0)
    with pytest.raises(ValueError, match="non-decreasing"):
        step_level_gae(rewards, rewards, mask, torch.tensor([[1, 1, -1, 0]]), 1.0, 1.0)
    with pytest.raises(ValueError, match="mode"):
        step_level_gae(rewards, rewards, mask, torch.tensor([[0, 0, -1, 1]]), 1.0, 1.0, mode="mean")
    with pytest.raises(TypeError, match="turn_ids must be an integer"):
        step_level_gae(rewards, rewards, mask, torch.zeros(1, 4), 1.0, 1.0)
    assert math.isfinite(
        step_level_gae(rewards, rewards, mask, torch.tensor([[0, 0, -1, 1]]), 1.0, 1.0)[0].sum().item())
