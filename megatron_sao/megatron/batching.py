"""Padded-batch checks, padding and splitting for the engine (pure tensor code, no collectives).

Contract: every rank passes the SAME full batch. A batch is a dict of tensors:
  tokens          int64 [B, T]   right-padded token ids
  attention_mask  bool/int [B, T] 1 on real tokens, then only 0s (right padding)
  any other key   [B, T] per-token fields (action_mask, rollout_logprobs, advantages, returns, ...)
                  or [B] per-row fields; they are sliced along rows with the tokens.
                  A per-token field may have trailing dims ([B, T, ...]: the MoE actor's `routes`
                  [B, T, layers, topk]); it is padded, split and trimmed like the [B, T] ones.

The engine pads rows up to a multiple of dp * micro_batch_size (padding rows are all-zero, so a
loss weighted by action_mask ignores them) and columns up to a multiple of `seq_multiple` (TP
under sequence parallel splits the sequence). Right padding never changes the outputs at real
positions because attention is causal. Each DP rank then takes a contiguous block of rows.

Packed (THD / cu_seqlens) batches are refused: the local CPU layer spec has no varlen attention.
"""

from __future__ import annotations

import torch

Batch = dict[str, torch.Tensor]
_PACKED_KEYS = ("cu_seqlens", "cu_seqlens_q", "packed_seq_params", "seq_lens")


def validate_batch(batch: Batch, *, required: tuple[str, ...] = ()) -> tuple[int, int]:
    """Check the padded-batch contract; returns (B, T). Raises ValueError naming the bad field."""
    if not isinstance(batch, dict):
        raise TypeError(f"batch must be a dict of tensors, got {type(batch).__name__}")
    packed = [k for k in _PACKED_KEYS if k in batch]
    if packed:
        raise NotImplementedError(
            f"packed (THD) batches are not supported (found {packed}): the local layer spec used on "
            "CPU has no variable-length attention; pass a right-padded [B, T] batch instead"
        )
    for key in ("tokens", "attention_mask", *required):
        if key not in batch:
            raise ValueError(f"batch is missing required field {key!r} (has {sorted(batch)})")
    tokens = batch["tokens"]
    if not torch.is_tensor(tokens) or tokens.dim() != 2 or tokens.dtype != torch.int64:
        raise ValueError(f"batch['tokens'] must be an int64 tensor [B, T], got "
                         f"{getattr(tokens, 'dtype', type(tokens))} {tuple(getattr(tokens, 'shape', ()))}")
    b, t = tokens.shape
    if b == 0 or t < 2:
        raise ValueError(f"batch['tokens'] must have B >= 1 rows and T >= 2 columns, got {(b, t)}")
    for key, value in batch.items():
        if not torch.is_tensor(value):
            raise ValueError(f"batch[{key!r}] must be a tensor, got {type(value).__name__}")
        if value.shape[:1] != (b,) or (value.dim() >= 2 and value.shape[:2] != (b, t)):
            raise ValueError(f"batch[{key!r}] has shape {tuple(value.shape)}; expected [B, T, ...]={[b, t]} "
                             f"or [B]={[b]}")
    mask = batch["attention_mask"].bool()
    if mask.dim() != 2:
        raise ValueError("batch['attention_mask'] must be [B, T]")
    # Right padding: once a row has a 0, it has only 0s after it (cummin of a 0/1 row is itself).
    if not torch.equal(mask.int().cummin(dim=1).values.bool(), mask):
        raise ValueError("batch['attention_mask'] must be right-padded (1s then 0s in every row); "
                         "left padding would shift positions and is not supported")
    return b, t


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_batch(batch: Batch, rows: int, cols: int) -> Batch:
    """Zero-pad every field to `rows` rows and (for [B, T] fields) `cols` columns."""
    b, t = batch["tokens"].shape
    if rows < b or cols < t:
        raise ValueError(f"cannot pad a [{b}, {t}] batch down to [{rows}, {cols}]")
    out: Batch = {}
    for key, value in batch.items():
        shape = (rows, cols, *value.shape[2:]) if value.dim() >= 2 else (rows,)
        padded = torch.zeros(shape, dtype=value.dtype, device=value.device)
        if value.dim() >= 2:
            padded[:b, :t] = value
        else:
            padded[:b] = value
        out[key] = padded
    return out


def slice_rows(batch: Batch, start: int, stop: int) -> Batch:
    return {k: v[start:stop] for k, v in batch.items()}


def split_micro_batches(batch: Batch, micro_batch_size: int) -> list[Batch]:
    """Consecutive row slices of `micro_batch_size` rows (rows must already be a multiple)."""
    b = batch["tokens"].shape[0]
    if b % micro_batch_size:
        raise ValueError(f"{b} rows are not a multiple of micro_batch_size={micro_batch_size}")
    return [slice_rows(batch, i, i + micro_batch_size) for i in range(0, b, micro_batch_size)]


def trimmed_widths(padded: Batch, dp: int, micro_batch_size: int, seq_multiple: int) -> list[int]:
    """Width of micro-batch i: the longest real row among the i-th micro-batches of ALL DP ranks.

    Every rank computes the same widths from the same full batch, with no communication. Taking
    the maximum over DP ranks matters for MoE: the expert dispatcher gathers tokens across ranks
    and needs the same token count on each.
    """
    mask = padded["attention_mask"].bool()
    rows, cols = mask.shape
    per_rank = rows // dp
    widths = []
    for i in range(per_rank // micro_batch_size):
        idx = [r * per_rank + i * micro_batch_size + j for r in range(dp) for j in range(micro_batch_size)]
        real = mask[idx].any(dim=0)
        last = int(real.nonzero().max()) + 1 if bool(real.any()) else 1
        widths.append(min(round_up(max(last, 2), seq_multiple), cols))
    return widths


def prepare_local_batch(
    batch: Batch, *, dp: int, dp_rank: int, micro_batch_size: int, seq_multiple: int,
    required: tuple[str, ...] = (), trim: bool = False,
) -> tuple[list[Batch], int, int, int]:
    """Validate, pad and cut this DP rank's micro-batches.

    Returns (micro_batches, B, T, padded_T); the global padded row count is
    round_up(B, dp * micro_batch_size) and this rank owns rows [dp_rank * R, (dp_rank + 1) * R).
    With `trim` each micro-batch drops the padding columns at its right (see trimmed_widths): a
    micro-batch of short rows does not pay for the batch's longest row. Causal attention keeps the
    outputs at real positions unchanged. Not for pipeline parallelism (one fixed p2p shape).
    """
    b, t = validate_batch(batch, required=required)
    rows = round_up(b, dp * micro_batch_size)
    cols = round_up(t, seq_multiple)
    padded = pad_batch(batch, rows, cols)
    per_rank = rows // dp
    local = slice_rows(padded, dp_rank * per_rank, (dp_rank + 1) * per_rank)
    micro = split_micro_batches(local, micro_batch_size)
    if trim:
        widths = trimmed_widths(padded, dp, micro_batch_size, seq_multiple)
        micro = [{k: (v[:, :w] if v.dim() >= 2 else v) for k, v in mb.items()} for mb, w in zip(micro, widths)]
    return micro, b, t, cols
