"""Input validation shared by the algorithm functions (private).

Every public function in this package validates its inputs up front so that a wrong shape, dtype or
range fails with an error naming the offending argument instead of broadcasting silently into a
plausible-looking but wrong tensor.
"""

from __future__ import annotations

import math

import torch


def check_tensor(x: object, name: str) -> torch.Tensor:
    """Raise TypeError unless ``x`` is a torch.Tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_float_tensor(x: object, name: str, ndim: int | None = None) -> torch.Tensor:
    """Raise unless ``x`` is a floating-point tensor (of ``ndim`` dimensions when given)."""
    x = check_tensor(x, name)
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(x.shape)}")
    return x


def check_mask(mask: object, name: str, shape: torch.Size | None = None) -> torch.Tensor:
    """Raise unless ``mask`` is a torch.bool tensor (of ``shape`` when given).

    Masks are strictly boolean: a float mask multiplied into a loss is the classic way NaNs from
    masked-out positions leak into gradients, so callers convert explicitly with ``.bool()``.
    """
    mask = check_tensor(mask, name)
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a torch.bool tensor, got dtype {mask.dtype}; pass {name}.bool()")
    if shape is not None and mask.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(mask.shape)}")
    return mask


def check_same_shape(reference_name: str, reference: torch.Tensor, **others: torch.Tensor) -> None:
    """Raise ValueError naming the first tensor whose shape or device differs from ``reference``."""
    for name, t in others.items():
        if t.shape != reference.shape:
            raise ValueError(
                f"{name} must have the same shape as {reference_name} {tuple(reference.shape)}, "
                f"got {tuple(t.shape)}"
            )
        if t.device != reference.device:
            raise ValueError(f"{name} is on {t.device} but {reference_name} is on {reference.device}")


def check_unit_interval(value: object, name: str) -> float:
    """Return ``value`` as a float, raising unless it is a finite real number in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not (0.0 <= value <= 1.0):
        raise ValueError(f"{name} must lie in [0, 1], got {value}")
    return value


def check_positive(value: object, name: str, allow_zero: bool = False) -> float:
    """Return ``value`` as a float, raising unless it is finite and > 0 (>= 0 with allow_zero)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    ok = value >= 0.0 if allow_zero else value > 0.0
    if not ok or not math.isfinite(value):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value}")
    return value


def row_lambda(lam: float | torch.Tensor, batch: int, like: torch.Tensor, name: str = "lam") -> torch.Tensor:
    """Return ``lam`` as a [B, 1] tensor with the dtype/device of ``like``, checking it lies in [0, 1].

    ``lam`` is either one float for every row or a [B] tensor (e.g. from ``adaptive_lambda``).
    """
    if isinstance(lam, torch.Tensor):
        if not lam.is_floating_point():
            raise TypeError(f"{name} must be a float or a floating-point [B] tensor, got dtype {lam.dtype}")
        if lam.shape != (batch,):
            raise ValueError(f"{name} as a tensor must have shape ({batch},), got {tuple(lam.shape)}")
        bad = ~((lam >= 0) & (lam <= 1))  # also catches NaN
        if bool(bad.any()):
            rows = bad.nonzero().flatten()[:8].tolist()
            raise ValueError(f"{name} must lie in [0, 1]; rows {rows} are out of range")
        return lam.to(dtype=like.dtype, device=like.device).unsqueeze(1)
    value = check_unit_interval(lam, name)
    return torch.full((batch, 1), value, dtype=like.dtype, device=like.device)


def row_bootstrap(bootstrap: torch.Tensor | None, batch: int, like: torch.Tensor) -> torch.Tensor:
    """Return bootstrap values as a [B] tensor like ``like`` (all zeros when None)."""
    if bootstrap is None:
        return torch.zeros(batch, dtype=like.dtype, device=like.device)
    bootstrap = check_float_tensor(bootstrap, "bootstrap_values", ndim=1)
    if bootstrap.shape[0] != batch:
        raise ValueError(f"bootstrap_values must have shape ({batch},), got {tuple(bootstrap.shape)}")
    if not bool(torch.isfinite(bootstrap).all()):
        raise ValueError("bootstrap_values must be finite (pass 0 for terminated rows)")
    return bootstrap.to(dtype=like.dtype, device=like.device)


def reject_off_mask_rewards(rewards: torch.Tensor, action_mask: torch.Tensor) -> None:
    """Raise ValueError if any reward sits outside the action mask.

    A skip-observation chain never visits an observation token, so a reward placed there would
    vanish silently; the trajectory contract puts rewards on the last action token instead.
    """
    off = (rewards != 0) & ~action_mask
    if bool(off.any()):
        count = int(off.sum())
        rows = off.any(dim=1).nonzero().flatten()[:8].tolist()
        raise ValueError(
            f"rewards has {count} nonzero value(s) outside action_mask (rows {rows}); "
            "put rewards on action tokens (the last one the policy generated)"
        )


def loss_denominator_value(
    loss_denominator: float | torch.Tensor | None, local_count: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The count a token-mean loss divides by, clamped to >= 1 so an empty batch gives loss 0.

    ``loss_denominator`` overrides the local action-token count with a global one (all micro-batches
    and data-parallel ranks) so per-micro-batch losses sum to the exact global mean.
    """
    if loss_denominator is None:
        denom = local_count
    elif isinstance(loss_denominator, torch.Tensor):
        if loss_denominator.numel() != 1:
            raise ValueError(f"loss_denominator must be a scalar, got shape {tuple(loss_denominator.shape)}")
        denom = loss_denominator.reshape(()).to(device=local_count.device)
        if bool(denom < 0) or not bool(torch.isfinite(denom)):
            raise ValueError(f"loss_denominator must be finite and >= 0, got {denom.item()}")
    else:
        denom = torch.tensor(check_positive(loss_denominator, "loss_denominator", allow_zero=True),
                             device=local_count.device)
    return denom.to(dtype).clamp(min=1.0)
