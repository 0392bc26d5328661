"""Reverse first-order linear recurrence along the last dimension, vectorized.

GAE is the recurrence ``x_t = d_t + c_t * x_{t+1}`` (``x_T = 0``) run backwards in time. A Python
loop over t costs one interpreter round trip per token; this module evaluates the recurrence with a
log-depth doubling (Hillis-Steele / Kogge-Stone) scan instead:

    after the level with span s, for every t
        x_t = sum_{k=t}^{t+s-1} (prod_{j=t}^{k-1} c_j) d_k      and      c_t = prod_{j=t}^{t+s-1} c_j
    and one level doubles the span:  x_t <- x_t + c_t * x_{t+s},   c_t <- c_t * c_{t+s}

(entries past the end count as d = c = 0). ceil(log2 T) levels, each a handful of elementwise
[..., T] operations, so 8192 tokens take 13 levels.

Why this and not the alternatives:
- closed form ``x_t = c^{-t} * revcumsum(c^k d_k)`` needs one constant c per row and divides by
  c^t, which underflows for c < 1 over thousands of tokens;
- a chunked matrix scan is faster on very long rows but needs a C x C discount matrix per row and a
  loop over chunks; the doubling scan is simpler, only ever multiplies coefficients in [0, 1]
  (no division, no overflow), and already runs far faster than the per-token loop
  (see benchmarks/bench_gae.py).
The association order differs from the sequential loop, so results agree with it to rounding
(~1e-15 relative in float64), not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_sao.algorithms._checks import check_float_tensor, check_same_shape


def reverse_linear_scan(deltas: torch.Tensor, coefs: torch.Tensor) -> torch.Tensor:
    """Solve ``x_t = deltas_t + coefs_t * x_{t+1}`` backwards along the last dim, with ``x_T = 0``.

    Args:
        deltas: [..., T] floating tensor.
        coefs: [..., T] tensor of the same shape and dtype; ``coefs_t`` links t to t+1, so a zero
            ends a chain at t and a one passes x_{t+1} through unchanged (deltas_t = 0).

    Returns:
        [..., T] tensor x, same dtype and device.
    """
    check_float_tensor(deltas, "deltas")
    check_float_tensor(coefs, "coefs")
    check_same_shape("deltas", deltas, coefs=coefs)
    if coefs.dtype != deltas.dtype:
        raise TypeError(f"coefs dtype {coefs.dtype} must match deltas dtype {deltas.dtype}")
    x, c = deltas, coefs
    length = deltas.shape[-1]
    span = 1
    while span < length:
        # Shift left by `span`, padding the tail with zeros (nothing lies past the end).
        x = x + c * F.pad(x[..., span:], (0, span))
        c = c * F.pad(c[..., span:], (0, span))
        span *= 2
    return x.clone() if x is deltas else x
