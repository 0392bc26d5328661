"""Padded-batch checks and the plan of who computes which rows, in which micro-batch, at what shape
(pure code, no collectives: every rank computes the same plan from the same full batch).

Contract: every rank passes the SAME full batch. A batch is a dict of tensors:
  tokens          int64 [B, T]   right-padded token ids
  attention_mask  bool/int [B, T] 1 on real tokens, then only 0s (right padding)
  any other key   [B, T, ...] per-token fields (action_mask, rollout_logprobs, advantages, returns,
                  routed experts, ...) or [B] per-row fields. Every field is cut along rows (and a
                  per-token one along columns) exactly like the tokens, so a new field needs no code here.

The plan (`plan_balanced`, docs/architecture.md "Balanced micro-batches"):
  1. rows go to DP ranks by a Karmarkar-Karp partition of their compute cost (`compute_cost.py`:
     tokens plus the attention term), not by position;
  2. each rank sorts its rows longest first and cuts them into micro-batches of at most
     `micro_batch_size` rows and `max_tokens` padded tokens (rows x width), each padded only to its
     own longest row (rounded up to `seq_multiple`: sequence parallel splits the sequence over TP);
  3. the shape rule of the layout (`ShapeRule`) adds what the collectives inside a forward need:
     the same number of micro-batches on every DP rank when an MoE layer's expert-parallel group spans
     DP ranks (every forward runs the dispatcher's collectives over it), the same [rows, width] per
     micro-batch index when that dispatcher is the allgather one (equal token counts), one fixed
     shape for pipeline parallelism (its p2p buffers). Missing micro-batches are dummies: zero rows,
     no attention, no action token, so they add zero to every loss and gradient.
Outputs come back in the batch's own order (`BatchPlan.rows_of`). Right padding never changes the
outputs at real positions: attention is causal.

`plan_contiguous` is the rule this replaced (sorted rows dealt in contiguous blocks, micro-batch i
padded to the widest i-th micro-batch of all ranks), kept as the baseline the gradient-equality test
and benchmarks/bench_batching.py compare against.

Packed (THD / cu_seqlens) batches are refused: the local CPU layer spec has no varlen attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_sao.megatron.compute_cost import CostModel
from megatron_sao.megatron.partition import karmarkar_karp

Batch = dict[str, torch.Tensor]
_PACKED_KEYS = ("cu_seqlens", "cu_seqlens_q", "packed_seq_params", "seq_lens")
BUDGET_KEY = "parallel.max_tokens_per_micro_batch"
# Under a token budget, the most padding a micro-batch of several rows may carry (see _cut).
MAX_PACKED_PADDING = 0.05


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
        if value.shape[:1] != (b,) or (value.dim() >= 2 and value.shape[1] != t):
            raise ValueError(f"batch[{key!r}] has shape {tuple(value.shape)}; expected per-token [B, T, ...]="
                             f"{[b, t]}+ or per-row [B]={[b]}")
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


def row_lengths(batch: Batch) -> list[int]:
    """Real tokens of every row (the attention mask's 1s)."""
    return [int(n) for n in batch["attention_mask"].bool().sum(dim=1).tolist()]


# ---------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class MicroBatchSlot:
    """One forward call: batch rows `rows` (in that order) in a [height, width] tensor; the rows past
    len(rows) are zero (padding rows, or a whole dummy micro-batch when rows is empty)."""

    rows: tuple[int, ...]
    height: int
    width: int

    @property
    def tokens(self) -> int:
        return self.height * self.width


@dataclass(frozen=True)
class ShapeRule:
    """What the layout's collectives need of the micro-batch shapes (see the module docstring).

    equal_count: every DP rank runs the same number of micro-batches (MoE with ep > 1).
    equal_shapes: micro-batch i has the same [height, width] on every DP rank (allgather dispatcher, ep > 1).
    fixed_shape: every micro-batch is [micro_batch_size, T] (pipeline parallel without variable_seq_lengths).
    """

    equal_count: bool = False
    equal_shapes: bool = False
    fixed_shape: bool = False


@dataclass(frozen=True)
class BatchPlan:
    per_rank: tuple[tuple[MicroBatchSlot, ...], ...]  # DP rank -> its micro-batches in order
    cols: int  # the batch's columns rounded up to seq_multiple: every output comes back this wide

    def rows_of(self, dp_rank: int) -> list[int]:
        """The batch rows rank `dp_rank` computes, in the order its outputs come out."""
        return [r for slot in self.per_rank[dp_rank] for r in slot.rows]


def _width(length: int, seq_multiple: int) -> int:
    return round_up(max(length, 2), seq_multiple)


def _check_budget(lengths: Sequence[int], max_tokens: int | None, seq_multiple: int) -> None:
    if max_tokens is None:
        return
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    w = _width(lengths[longest], seq_multiple)
    if w > max_tokens:
        raise ValueError(f"{BUDGET_KEY}={max_tokens} is smaller than row {longest} of the batch "
                         f"({lengths[longest]} tokens, {w} padded to a multiple of {seq_multiple}): a "
                         f"micro-batch holds at least one whole row; raise the budget to >= model.max_seq_len")


def _cut(rows: list[int], lengths: Sequence[int], micro_batch_size: int, max_tokens: int | None,
         seq_multiple: int) -> list[MicroBatchSlot]:
    """Rows sorted longest first, cut greedily: a micro-batch takes the next row while it stays within
    micro_batch_size rows, max_tokens padded tokens (its width is its first, longest row's) and
    MAX_PACKED_PADDING of padding. The last bound keeps a short row from riding along in a long row's
    micro-batch at the long row's width: packing saves per-call overhead, which is small next to a
    row of thousands of tokens, while padding costs its full share of compute."""
    order = sorted(rows, key=lambda r: (-lengths[r], r))
    slots: list[MicroBatchSlot] = []
    i = 0
    while i < len(order):
        width = _width(lengths[order[i]], seq_multiple)
        cap = micro_batch_size if max_tokens is None else min(micro_batch_size, max_tokens // width)
        take, real = [order[i]], lengths[order[i]]
        for r in order[i + 1:i + max(cap, 1)]:
            padded = (len(take) + 1) * width
            if max_tokens is not None and padded - (real + lengths[r]) > MAX_PACKED_PADDING * padded:
                break
            take.append(r)
            real += lengths[r]
        slots.append(MicroBatchSlot(tuple(take), len(take), width))
        i += len(take)
    return slots


def _split_to(slots: list[MicroBatchSlot], count: int, lengths: Sequence[int], seq_multiple: int,
              dummy: MicroBatchSlot) -> list[MicroBatchSlot]:
    """`count` micro-batches out of `slots`: halve the one with the most rows while that adds one,
    then append dummies. Splitting costs no compute (the same rows, never wider); a dummy costs a
    forward of `dummy`'s shape."""
    slots = list(slots)
    while len(slots) < count:
        big = max(range(len(slots)), key=lambda j: (slots[j].height, -j), default=None)
        if big is None or len(slots[big].rows) < 2:
            break
        rows = slots[big].rows
        half = (len(rows) + 1) // 2
        parts = [rows[:half], rows[half:]]
        slots[big:big + 1] = [MicroBatchSlot(p, len(p), _width(lengths[p[0]], seq_multiple)) for p in parts]
    return slots + [dummy] * (count - len(slots))


def plan_balanced(lengths: Sequence[int], *, dp: int, micro_batch_size: int, max_tokens: int | None,
                  seq_multiple: int, cost: CostModel, rule: ShapeRule = ShapeRule()) -> BatchPlan:
    """The plan of the module docstring for rows of `lengths` real tokens over `dp` ranks."""
    if not lengths:
        raise ValueError("a batch needs at least one row")
    cols = _width(max(lengths), seq_multiple)
    _check_budget(lengths, max_tokens, seq_multiple)
    parts = karmarkar_karp([cost.row(_width(n, seq_multiple)) for n in lengths], dp)
    if rule.fixed_shape:
        height = micro_batch_size if max_tokens is None else max(1, min(micro_batch_size, max_tokens // cols))
        per_rank = []
        for part in parts:
            order = sorted(part, key=lambda r: (-lengths[r], r))
            per_rank.append([MicroBatchSlot(tuple(order[i:i + height]), height, cols)
                             for i in range(0, len(order), height)])
        count = max(map(len, per_rank)) if rule.equal_count else None
        empty = MicroBatchSlot((), height, cols)
        per_rank = [s + [empty] * ((count or max(len(s), 1)) - len(s)) for s in per_rank]
    elif rule.equal_shapes:
        per_rank = _cut_jointly(parts, lengths, micro_batch_size, max_tokens, seq_multiple)
    else:
        per_rank = [_cut(part, lengths, micro_batch_size, max_tokens, seq_multiple) for part in parts]
        dummy = MicroBatchSlot((), 1, _width(2, seq_multiple))
        count = max(map(len, per_rank)) if rule.equal_count else 1
        per_rank = [_split_to(s, max(count, len(s), 1), lengths, seq_multiple, dummy) for s in per_rank]
    return BatchPlan(tuple(tuple(s) for s in per_rank), cols)


def _cut_jointly(parts: list[list[int]], lengths: Sequence[int], micro_batch_size: int, max_tokens: int | None,
                 seq_multiple: int) -> list[list[MicroBatchSlot]]:
    """Micro-batch i has one [height, width] on every rank (the allgather dispatcher gathers equal
    token counts): its width is the longest next row of any rank, its height what the budget allows at
    that width and what keeps every rank's own rows within MAX_PACKED_PADDING of it, and every rank
    takes up to that many of its own next rows (longest first)."""
    queues = [sorted(p, key=lambda r: (-lengths[r], r)) for p in parts]
    per_rank: list[list[MicroBatchSlot]] = [[] for _ in parts]
    while any(queues):
        width = max(_width(lengths[q[0]], seq_multiple) for q in queues if q)
        height = micro_batch_size if max_tokens is None else max(1, min(micro_batch_size, max_tokens // width))
        if max_tokens is not None:
            for q in queues:
                real = 0
                for n, r in enumerate(q[:height]):
                    real += lengths[r]
                    if n and (n + 1) * width - real > MAX_PACKED_PADDING * (n + 1) * width:
                        height = n
                        break
        for r, q in enumerate(queues):
            take, queues[r] = q[:height], q[height:]
            per_rank[r].append(MicroBatchSlot(tuple(take), height, width))
    return per_rank


def plan_contiguous(lengths: Sequence[int], *, dp: int, micro_batch_size: int, seq_multiple: int,
                    fixed_shape: bool = False) -> BatchPlan:
    """The rule before the balanced plan: rows sorted shortest first (the trainer sorted its batches),
    padded to a multiple of dp * micro_batch_size, rank r takes the r-th contiguous block, and
    micro-batch i is as wide as the widest i-th micro-batch of all ranks (the whole batch under PP)."""
    order = sorted(range(len(lengths)), key=lambda r: lengths[r])
    rows = round_up(len(order), dp * micro_batch_size)
    per = rows // dp
    cols = _width(max(lengths), seq_multiple)
    per_rank: list[list[MicroBatchSlot]] = [[] for _ in range(dp)]
    for i in range(per // micro_batch_size):
        blocks = [[order[p] for p in range(r * per + i * micro_batch_size, r * per + (i + 1) * micro_batch_size)
                   if p < len(order)] for r in range(dp)]
        real = [lengths[x] for block in blocks for x in block]
        width = cols if fixed_shape else min(_width(max(real, default=1), seq_multiple), cols)
        for r in range(dp):
            per_rank[r].append(MicroBatchSlot(tuple(blocks[r]), micro_batch_size, width))
    return BatchPlan(tuple(tuple(s) for s in per_rank), cols)


# ------------------------------------------------------------------------------- tensors and stats
def micro_batches(batch: Batch, plan: BatchPlan, dp_rank: int) -> list[Batch]:
    """The tensors of rank `dp_rank`'s micro-batches: every field's rows gathered, cut (per-token
    fields) to the slot's width and zero-padded to its [height, width]."""
    out = []
    for slot in plan.per_rank[dp_rank]:
        idx = torch.tensor(slot.rows, dtype=torch.long, device=batch["tokens"].device)
        mb: Batch = {}
        for key, value in batch.items():
            shape = (slot.height, slot.width, *value.shape[2:]) if value.dim() >= 2 else (slot.height,)
            t = torch.zeros(shape, dtype=value.dtype, device=value.device)
            if slot.rows:
                rows = value.index_select(0, idx.to(value.device))  # routes stay on the host (engine._local)
                if value.dim() >= 2:
                    w = min(slot.width, value.shape[1])
                    t[:len(slot.rows), :w] = rows[:, :w]
                else:
                    t[:len(slot.rows)] = rows
            mb[key] = t
        out.append(mb)
    return out


@dataclass(frozen=True)
class PlanStats:
    """compute_ratio: the busiest rank's padded cost over the ideal (total real cost / dp);
    padding_fraction: padded tokens that are not real tokens, over all computed tokens;
    forward_calls: micro-batches per rank."""

    compute_ratio: float
    padding_fraction: float
    forward_calls: tuple[int, ...]


def plan_stats(plan: BatchPlan, lengths: Sequence[int], cost: CostModel) -> PlanStats:
    per_rank_cost = [sum(cost.padded(s.height, s.width) for s in slots) for slots in plan.per_rank]
    ideal = sum(cost.row(n) for n in lengths) / len(plan.per_rank)
    computed = sum(s.tokens for slots in plan.per_rank for s in slots)
    return PlanStats(compute_ratio=max(per_rank_cost) / ideal,
                     padding_fraction=1.0 - sum(lengths) / computed,
                     forward_calls=tuple(len(s) for s in plan.per_rank))
