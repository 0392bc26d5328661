"""Masked reductions: sum, mean, variance and whitening over the True entries of a bool mask.

Masked-out entries are excluded with ``torch.where`` (never multiplied by 0), so a NaN or inf in a
padded or observation position cannot leak into the statistic or its gradient.
An empty mask gives mean 0 and variance 0 (a logging-friendly convention; nothing is divided by 0).
"""

from __future__ import annotations

import torch

from megatron_sao.algorithms._checks import check_float_tensor, check_mask, check_positive


def _validated(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = check_float_tensor(x, "x")
    mask = check_mask(mask, "mask", shape=x.shape)
    if mask.device != x.device:
        raise ValueError(f"mask is on {mask.device} but x is on {x.device}")
    return x, mask


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum_{i: mask_i} x_i, over all entries (dim=None) or along ``dim``."""
    x, mask = _validated(x, mask)
    zeros = torch.zeros((), dtype=x.dtype, device=x.device)
    kept = torch.where(mask, x, zeros)
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_count(mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Number of True entries (int64), over all entries or along ``dim``."""
    mask = check_mask(mask, "mask")
    return mask.sum() if dim is None else mask.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """mean = sum_{mask} x / max(n, 1), n = number of True entries; 0 for an empty mask."""
    total = masked_sum(x, mask, dim)
    count = masked_count(mask, dim).to(x.dtype).clamp(min=1)
    return total / count


def masked_var(
    x: torch.Tensor, mask: torch.Tensor, dim: int | None = None, unbiased: bool = False
) -> torch.Tensor:
    """var = sum_{mask} (x - mean)^2 / (n - 1 if unbiased else n), computed in two passes.

    The two-pass form (subtract the mean first) avoids the cancellation of E[x^2] - E[x]^2.
    Returns 0 when n <= 1 with unbiased=True or n == 0 otherwise (no division by zero).
    """
    mean = masked_mean(x, mask, dim)
    centred = x - (mean if dim is None else mean.unsqueeze(dim))
    sq = masked_sum(centred * centred, mask, dim)
    count = masked_count(mask, dim).to(x.dtype)
    denom = count - 1 if unbiased else count
    return sq / denom.clamp(min=1)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Whiten x over the mask: (x - mean) / sqrt(var + eps), plus mean again if not shift_mean.

    Statistics are over all masked entries of the tensor (batch-level whitening, as in PPO
    advantage normalization); var is the biased (1/n) variance. Entries off the mask are 0 in the
    output, so whitened advantages keep the "exactly 0 off the action mask" contract.
    """
    eps = check_positive(eps, "eps", allow_zero=True)
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, torch.zeros((), dtype=out.dtype, device=out.device))
