"""Critic-free baselines for the paper's comparisons: GRPO group normalization, running mean.

Both produce one scalar advantage per trajectory; ``broadcast_to_tokens`` spreads it over the
trajectory's action tokens so it plugs into the same token-level losses as GAE advantages.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from megatron_sao.algorithms._checks import (
    check_float_tensor,
    check_mask,
    check_positive,
    check_tensor,
)


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6, normalize_std: bool = True
) -> torch.Tensor:
    """GRPO group-normalized advantage per trajectory.

        A_i = (r_i - mean_g) / (std_g + eps)      (normalize_std=True)
        A_i =  r_i - mean_g                       (normalize_std=False, "Dr. GRPO")

    over the trajectories i sharing group g (same prompt). std_g is the unbiased (n - 1) sample
    standard deviation, as in TRL and verl. A group of one trajectory has no baseline to compare
    against: its advantage is 0 (rather than verl's r / (1 + eps)); so is every advantage of a
    group whose rewards are all equal, even with eps = 0.

    Args:
        rewards: [N] float rewards.
        group_ids: [N] integer group labels (any values; they need not be contiguous).
        eps: added to std_g, >= 0.
        normalize_std: divide by std_g + eps.

    Returns:
        [N] advantages with the dtype of ``rewards``.
    """
    rewards = check_float_tensor(rewards, "rewards", ndim=1)
    group_ids = check_tensor(group_ids, "group_ids")
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise TypeError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids must have shape {tuple(rewards.shape)}, got {tuple(group_ids.shape)}")
    eps = check_positive(eps, "eps", allow_zero=True)
    if rewards.numel() == 0:
        return rewards.clone()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    counts = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, inverse, torch.ones_like(rewards)
    )
    sums = torch.zeros_like(counts).index_add_(0, inverse, rewards)
    means = sums / counts
    centred = rewards - means[inverse]
    singleton = counts[inverse] < 2
    if not normalize_std:
        return torch.where(singleton, torch.zeros_like(centred), centred)
    sq = torch.zeros_like(counts).index_add_(0, inverse, centred * centred)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    denom = std[inverse] + eps
    # A group of equal rewards has centred == 0; with eps = 0 that would be 0/0, so define it as 0.
    degenerate = singleton | (denom == 0)
    adv = centred / torch.where(degenerate, torch.ones_like(denom), denom)
    return torch.where(degenerate, torch.zeros_like(adv), adv)


def broadcast_to_tokens(advantages: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Token advantages [B, T]: A_{b,t} = advantages[b] on action tokens, exactly 0 elsewhere."""
    advantages = check_float_tensor(advantages, "advantages", ndim=1)
    action_mask = check_mask(action_mask, "action_mask")
    if action_mask.dim() != 2 or action_mask.shape[0] != advantages.shape[0]:
        raise ValueError(
            f"action_mask must have shape ({advantages.shape[0]}, T), got {tuple(action_mask.shape)}"
        )
    zero = torch.zeros((), dtype=advantages.dtype, device=advantages.device)
    return torch.where(action_mask, advantages.unsqueeze(1), zero)


class RunningMeanBaseline:
    """Baseline b = mean of the last ``window`` trajectory rewards; advantage A_i = r_i - b.

    The paper's "running-mean baseline instead of a critic" ablation. ``advantages`` uses only
    rewards from earlier ``update`` calls, so a trajectory's own reward never enters its baseline;
    with no history yet the baseline is ``initial`` (default 0). Call ``advantages(r)`` then
    ``update(r)`` for each batch. The window counts trajectories, not batches: under a changing
    reward (the online style-shift task) the baseline lags by about ``window`` trajectories.
    State is plain Python (floats), so ``state_dict`` round-trips through any checkpoint format.
    """

    def __init__(self, window: int, initial: float = 0.0) -> None:
        if isinstance(window, bool) or not isinstance(window, int):
            raise TypeError(f"window must be an int, got {type(window).__name__}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if isinstance(initial, bool) or not isinstance(initial, (int, float)):
            raise TypeError(f"initial must be a float, got {type(initial).__name__}")
        self.window = window
        self.initial = float(initial)
        self._history: deque[float] = deque(maxlen=window)

    def __len__(self) -> int:
        return len(self._history)

    @property
    def value(self) -> float:
        """The current baseline: mean of the stored rewards, or ``initial`` if none yet."""
        if not self._history:
            return self.initial
        return sum(self._history) / len(self._history)

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """A_i = r_i - baseline, for a [B] float tensor of rewards (does not update the state)."""
        rewards = check_float_tensor(rewards, "rewards", ndim=1)
        return rewards - self.value

    def update(self, rewards: torch.Tensor) -> None:
        """Append the rewards ([B], in order) to the window, dropping the oldest beyond ``window``."""
        rewards = check_float_tensor(rewards, "rewards", ndim=1)
        if not bool(torch.isfinite(rewards).all()):
            raise ValueError("rewards must be finite to enter the running-mean baseline")
        self._history.extend(float(r) for r in rewards.detach().cpu().tolist())

    def state_dict(self) -> dict[str, Any]:
        """{"window": int, "initial": float, "history": list[float] (oldest first)}."""
        return {"window": self.window, "initial": self.initial, "history": list(self._history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict``; the window must match the one this object was built with."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        for key in ("window", "initial", "history"):
            if key not in state:
                raise ValueError(f"state is missing key {key!r}")
        if state["window"] != self.window:
            raise ValueError(f"state window {state['window']} does not match this baseline's {self.window}")
        history = [float(r) for r in state["history"]]
        if len(history) > self.window:
            raise ValueError(f"state history has {len(history)} entries, more than window {self.window}")
        self.initial = float(state["initial"])
        self._history = deque(history, maxlen=self.window)
