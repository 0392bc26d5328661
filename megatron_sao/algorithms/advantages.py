"""Advantage estimators: SAO's skip-observation token GAE, its length-adaptive lambda, step-level GAE.

All tensors are [B, T] (batch rows, token positions) unless stated. ``action_mask`` is True exactly
on tokens the policy sampled; everything else (prompt, tool/environment observations, padding) is
"off the mask". Advantages and returns are exactly 0 off the mask.

The baselines used in the paper's comparisons (GRPO group normalization, running-mean baseline) and
masked whitening live in ``baselines.py`` / ``masked.py`` and are re-exported here so that every
advantage estimator is reachable as ``advantages.<name>``.
"""

from __future__ import annotations

import torch

from megatron_sao.algorithms._checks import (
    check_float_tensor,
    check_mask,
    check_positive,
    check_same_shape,
    check_tensor,
    check_unit_interval,
    reject_off_mask_rewards,
    row_bootstrap,
    row_lambda,
)
from megatron_sao.algorithms.baselines import RunningMeanBaseline, broadcast_to_tokens, grpo_advantages
from megatron_sao.algorithms.masked import masked_mean, masked_var, masked_whiten
from megatron_sao.algorithms.scan import discounted_cumsum

__all__ = [
    "skip_observation_gae",
    "adaptive_lambda",
    "step_level_gae",
    "grpo_advantages",
    "broadcast_to_tokens",
    "RunningMeanBaseline",
    "masked_mean",
    "masked_var",
    "masked_whiten",
]


def _validate_token_inputs(
    rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor
) -> None:
    check_float_tensor(rewards, "rewards", ndim=2)
    check_float_tensor(values, "values", ndim=2)
    check_mask(action_mask, "action_mask")
    check_same_shape("rewards", rewards, values=values, action_mask=action_mask)
    if values.dtype != rewards.dtype:
        raise TypeError(f"values dtype {values.dtype} must match rewards dtype {rewards.dtype}")


def _reversed_slots(action_mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Slot of each action token when a row's action tokens are packed left in reversed order.

    Slot 0 is the row's last action token, slot count-1 its first; non-action tokens get the
    trash slot ``width`` (= the largest count). O(B*T) via cumsum, no sort.
    """
    from_end = action_mask.flip(1).long().cumsum(dim=1).flip(1)  # action tokens at >= t
    width = int(from_end[:, 0].max()) if from_end.numel() else 0
    slot = torch.where(action_mask, from_end - 1, torch.full_like(from_end, width))
    return slot, width


def _pack(x: torch.Tensor, slot: torch.Tensor, width: int) -> torch.Tensor:
    """Scatter x into [B, width] at ``slot`` (entries past a row's count are 0).

    Non-action tokens land in an extra trash column that is cut off, so their values (even NaN)
    never reach the packed tensor.
    """
    packed = torch.zeros(x.shape[0], width + 1, dtype=x.dtype, device=x.device)
    return packed.scatter_(1, slot, x)[:, :width]


@torch.no_grad()
def skip_observation_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
    bootstrap_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE whose chain visits action tokens only (SAO's skip-observation GAE).

    For consecutive action tokens t < t' of one row (t' = the next action token after t, with any
    observation tokens between them skipped; the last token of action i links straight to the
    first token of action i+1):

        delta_t = r_t + gamma * V_{t'} - V_t
        A_t     = delta_t + gamma * lam_b * A_{t'}

    After the last action token of row b the next value is ``bootstrap_values[b]`` and the chain
    ends (A_{t'} = 0). Returns R_t = A_t + V_t on action tokens. Off the action mask both outputs
    are exactly 0, and values or rewards there are never read (a NaN in an observation value cannot
    leak). Rows with no action token give all zeros.

    SAO uses this twice per batch: with the length-adaptive ``lam`` (``adaptive_lambda``) for the
    policy advantages, and with lam=1 for the critic's returns.

    Implementation: each row's action tokens are packed to the left in reversed time order
    (cumsum + scatter, O(B*T), no sort), which turns the chain into a forward
    ``discounted_cumsum`` with one discount gamma*lam_b per row (blocked cumsums, see scan.py);
    a gather puts the result back in place. No Python loop over rows or tokens; CPU and CUDA,
    float32/float64. Runs under ``torch.no_grad`` (outputs are regression/policy targets).

    Args:
        rewards: [B, T] float; nonzero only on action tokens (the trajectory contract puts the
            reward on the last action token). A nonzero reward off the mask raises ValueError.
        values: [B, T] float critic values V_t, same dtype as rewards.
        action_mask: [B, T] bool.
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1], one float or a [B] tensor (one per row).
        bootstrap_values: [B] value after the last action token. The caller passes the critic's
            value for truncated rows and 0 for terminated rows; None means all rows terminated.

    Returns:
        (advantages, returns), both [B, T] with the dtype of ``values``.
    """
    _validate_token_inputs(rewards, values, action_mask)
    gamma = check_unit_interval(gamma, "gamma")
    batch, _ = rewards.shape
    lam_rows = row_lambda(lam, batch, values)  # [B, 1]
    bootstrap = row_bootstrap(bootstrap_values, batch, values)  # [B]

    slot, width = _reversed_slots(action_mask)
    packed_rewards = _pack(rewards, slot, width)
    # Cheap exact test (rewards are sparse): every nonzero reward must survive the packing.
    if int(torch.count_nonzero(packed_rewards)) != int(torch.count_nonzero(rewards)):
        reject_off_mask_rewards(rewards, action_mask)  # raises, naming the count and rows
    if width == 0:
        return torch.zeros_like(values), torch.zeros_like(values)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    packed_values = _pack(values, slot, width)
    # Slot p-1 holds the next action token after slot p; slot 0 (the row's last action) takes the
    # bootstrap. Slots past a row's count hold garbage that the forward recurrence never reads back.
    next_value = torch.cat([bootstrap.unsqueeze(1), packed_values[:, :-1]], dim=1)
    deltas = packed_rewards + gamma * next_value - packed_values
    packed_adv = discounted_cumsum(deltas, gamma * lam_rows.squeeze(1))
    advantages = torch.where(action_mask, packed_adv.gather(1, slot.clamp(max=width - 1)), zero)
    returns = torch.where(action_mask, advantages + values, zero)
    return advantages, returns


def adaptive_lambda(
    action_lengths: torch.Tensor, alpha: float, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """SAO's length-adaptive policy lambda: lam = clip(1 - 1 / (alpha * l), 0, 1) per row.

    l is the number of action tokens of the row; l = 0 gives 0 (no chain to weigh). Longer
    trajectories get lam closer to 1, so the effective horizon 1/(1 - lam) = alpha * l grows with
    the trajectory length (paper: alpha = 1.5).

    Args:
        action_lengths: [B] integer (or integral float) tensor, >= 0; e.g. ``action_mask.sum(1)``.
        alpha: > 0.
        dtype: output float dtype (default: torch's default dtype).

    Returns:
        [B] float tensor in [0, 1].
    """
    action_lengths = check_tensor(action_lengths, "action_lengths")
    if action_lengths.dim() != 1:
        raise ValueError(f"action_lengths must have shape (B,), got {tuple(action_lengths.shape)}")
    if action_lengths.dtype == torch.bool or action_lengths.is_complex():
        raise TypeError(f"action_lengths must be an integer or float tensor, got {action_lengths.dtype}")
    alpha = check_positive(alpha, "alpha")
    if bool((action_lengths < 0).any()):
        raise ValueError("action_lengths must be >= 0")
    out_dtype = dtype or torch.get_default_dtype()
    lengths = action_lengths.to(out_dtype)
    safe = lengths.clamp(min=1)  # avoid 1/0 where l = 0; those rows are set to 0 below
    lam = (1.0 - 1.0 / (alpha * safe)).clamp(0.0, 1.0)
    return torch.where(lengths > 0, lam, torch.zeros_like(lam))


def _turn_tables(
    turn_ids: torch.Tensor, action_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate turn_ids and return (steps per row [B], tokens per step [B, S], clamped ids [B, T])."""
    check_tensor(turn_ids, "turn_ids")
    if turn_ids.dtype.is_floating_point or turn_ids.dtype == torch.bool:
        raise TypeError(f"turn_ids must be an integer tensor, got dtype {turn_ids.dtype}")
    check_same_shape("action_mask", action_mask, turn_ids=turn_ids)
    if bool(((turn_ids >= 0) != action_mask).any()):
        raise ValueError("turn_ids must be >= 0 exactly on action tokens and -1 elsewhere")
    ids = turn_ids.clamp(min=0).long()
    batch = ids.shape[0]
    # Non-decreasing along the action tokens <=> every id equals the running max so far.
    if bool((action_mask & (turn_ids < turn_ids.cummax(dim=1).values)).any()):
        raise ValueError("turn_ids must be non-decreasing along each row's action tokens")
    n_steps = torch.where(action_mask, ids + 1, torch.zeros_like(ids)).amax(dim=1)  # [B]
    max_steps = max(int(n_steps.max()) if batch else 0, 1)
    counts = torch.zeros(batch, max_steps, dtype=torch.long, device=ids.device)
    counts.scatter_add_(1, ids, action_mask.long())
    in_row = torch.arange(max_steps, device=ids.device) < n_steps.unsqueeze(1)
    if bool((in_row & (counts == 0)).any()):
        raise ValueError("turn_ids must number each row's turns 0..n-1 without gaps")
    return n_steps, counts, ids


@torch.no_grad()
def step_level_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    turn_ids: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
    mode: str = "turn_avg",
    bootstrap_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-level GAE (the paper's granularity ablation): each action turn is one step.

    For row b with turns k = 0..n-1:
        R_k = sum of r_t over the turn's tokens
        V_k = mean of V_t over the turn's tokens            (mode="turn_avg")
            = V_t at the turn's last token                  (mode="turn_last")
        delta_k = R_k + gamma * V_{k+1} - V_k,  V_n = bootstrap_values[b] (0 when None)
        A_k = delta_k + gamma * lam_b * A_{k+1},  A_n = 0
    Every token of turn k gets A_k as its advantage and A_k + V_k as its return (the critic target
    for step-level training). Both are exactly 0 off the action mask.

    Args:
        rewards, values, action_mask: as in ``skip_observation_gae``.
        turn_ids: [B, T] integer, -1 off action tokens, the turn index 0..n-1 on action tokens
            (non-decreasing along the row, no gaps).
        gamma, lam, bootstrap_values: as in ``skip_observation_gae`` (lam per row or one float).
        mode: "turn_avg" or "turn_last".

    Returns:
        (advantages, returns), [B, T].
    """
    _validate_token_inputs(rewards, values, action_mask)
    if rewards.shape[1] == 0:
        return torch.zeros_like(values), torch.zeros_like(values)
    if mode not in ("turn_avg", "turn_last"):
        raise ValueError(f"mode must be 'turn_avg' or 'turn_last', got {mode!r}")
    gamma = check_unit_interval(gamma, "gamma")
    batch, length = rewards.shape
    lam_rows = row_lambda(lam, batch, values)
    bootstrap = row_bootstrap(bootstrap_values, batch, values)
    reject_off_mask_rewards(rewards, action_mask)
    n_steps, counts, ids = _turn_tables(turn_ids, action_mask)
    max_steps = counts.shape[1]

    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    step_rewards = torch.zeros(batch, max_steps, dtype=values.dtype, device=values.device)
    step_rewards.scatter_add_(1, ids, torch.where(action_mask, rewards, zero))
    if mode == "turn_avg":
        step_values = torch.zeros_like(step_rewards)
        step_values.scatter_add_(1, ids, torch.where(action_mask, values, zero))
        step_values = step_values / counts.clamp(min=1).to(values.dtype)
    else:
        positions = torch.arange(length, device=ids.device).expand(batch, length)
        last_pos = torch.zeros(batch, max_steps, dtype=torch.long, device=ids.device)
        last_pos.scatter_reduce_(1, ids, torch.where(action_mask, positions, 0), reduce="amax")
        step_values = values.gather(1, last_pos)

    step_idx = torch.arange(max_steps, device=ids.device).expand(batch, max_steps)
    in_row = step_idx < n_steps.unsqueeze(1)
    has_next = step_idx + 1 < n_steps.unsqueeze(1)
    following = torch.cat([step_values[:, 1:], step_values[:, :1]], dim=1)  # V_{k+1}, last wraps
    next_value = torch.where(has_next, following, bootstrap.unsqueeze(1))
    deltas = torch.where(in_row, step_rewards + gamma * next_value - step_values, zero)
    # Backward in steps = forward over the flipped steps; deltas past a row's last step are 0,
    # so after the flip they precede the chain and contribute nothing.
    step_adv = discounted_cumsum(deltas.flip(1), gamma * lam_rows.squeeze(1)).flip(1)
    step_ret = torch.where(in_row, step_adv + step_values, zero)
    advantages = torch.where(action_mask, step_adv.gather(1, ids), zero)
    returns = torch.where(action_mask, step_ret.gather(1, ids), zero)
    return advantages, returns
