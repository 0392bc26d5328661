"""Balanced k-way partition of weighted items: Karmarkar-Karp's largest differencing method.

The method verl (`verl/utils/seqlen_balancing.py`), slime and OpenRLHF balance sequence lengths
with: start with one partial solution per item (the item alone in one of k sets, the others empty),
and repeatedly take the two partial solutions whose largest and smallest set differ most, and merge
them by pairing the heaviest set of one with the lightest of the other. Differencing the big items
against each other first leaves the small ones to even out the remainder, which is why it beats
greedy LPT on long-tailed lengths. O(n log n * k).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Sequence


def karmarkar_karp(weights: Sequence[float], k: int) -> list[list[int]]:
    """Indices of `weights` in k sets whose sums are balanced; sets may differ in size (some may be
    empty when there are fewer items than sets). Deterministic: the same weights give the same sets."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if any(w < 0 for w in weights):
        raise ValueError("weights must be >= 0")
    if k == 1 or not weights:
        return [list(range(len(weights)))] + [[] for _ in range(k - 1)]
    tie = itertools.count()  # stable order among equal spreads
    heap = []
    for i, w in sorted(enumerate(weights), key=lambda iw: (iw[1], iw[0])):
        sets = [(float(w), [i])] + [(0.0, []) for _ in range(k - 1)]  # heaviest first
        heapq.heappush(heap, (-float(w), next(tie), sets))
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # a and b are sorted heaviest first: a's heaviest takes b's lightest, and so on.
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next(tie), merged))
    return [sorted(items) for _, items in heap[0][2]]
