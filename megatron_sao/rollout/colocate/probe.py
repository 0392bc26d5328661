"""Seconds and memory of each colocated phase, as trace records and metrics.

Memory is what the device holds after the call: on a GPU ``total - free`` from
``torch.cuda.mem_get_info`` (vLLM's sleep-mode memory is mapped with the CUDA driver, outside torch's
allocator, so ``memory_allocated`` alone would miss it; one process per GPU makes the device figure
this rank's), plus torch's own ``memory_allocated``. On a CPU build the process RSS, and the bytes the
phase moved (trainer state offloaded, KV cache freed) from the parts themselves.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def device_memory() -> dict[str, int]:
    """This rank's device memory now (GPU) or the process RSS (CPU build)."""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return {"device_used_bytes": int(total - free), "torch_allocated_bytes": int(torch.cuda.memory_allocated())}
    try:
        with open("/proc/self/statm") as f:
            return {"rss_bytes": int(f.read().split()[1]) * _PAGE}
    except OSError:
        return {}


@dataclass
class PhaseProbe:
    """Records each phase call of this rank: name, seconds, memory after it, what it observed."""

    rank: int
    step: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)

    def run(self, call: str, fn: Callable[[], Any], observe: Callable[[], dict] | None = None, **extra) -> Any:
        t0 = time.perf_counter()
        out = fn()
        rec = {"step": self.step, "rank": self.rank, "call": call, "s": round(time.perf_counter() - t0, 4),
               **device_memory(), **extra}
        if isinstance(out, dict):
            rec["result"] = out
        elif isinstance(out, int) and not isinstance(out, bool):
            rec["bytes"] = out
        if observe is not None:
            rec.update(observe())
        self.records.append(rec)
        return out

    def mark(self, call: str, seconds: float, observe: Callable[[], dict] | None = None, **extra) -> None:
        """A phase the caller timed itself (the train step between the hooks, the rollout phase)."""
        rec = {"step": self.step, "rank": self.rank, "call": call, "s": round(seconds, 4), **device_memory(), **extra}
        if observe is not None:
            rec.update(observe())
        self.records.append(rec)

    def take(self) -> list[dict[str, Any]]:
        out, self.records = self.records, []
        return out


def phase_metrics(records: list[dict[str, Any]], prefix: str = "colocate/") -> dict[str, float]:
    """Per-phase seconds and memory of one rank's records (repeated calls add up / keep the last)."""
    out: dict[str, float] = {}
    for r in records:
        key = prefix + r["phase"]
        out[key + "_s"] = out.get(key + "_s", 0.0) + r["s"]
        for mem in ("device_used_bytes", "rss_bytes"):
            if mem in r:
                out[f"{key}_{mem}"] = r[mem]
        if "bytes" in r:
            out[key + "_moved_bytes"] = out.get(key + "_moved_bytes", 0) + r["bytes"]
    return out
