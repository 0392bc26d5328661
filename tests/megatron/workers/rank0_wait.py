"""Two ranks, a tiny process-group timeout, and rank-0-only phases longer than it.

Usage: torchrun --nproc_per_node 2 rank0_wait.py <tmp_dir> <pg_timeout_s> <rank0_phase_s>

Drives the trainer's own helpers (SAOTrainer._next_batch, _stop_agreed, _barrier) on a real gloo
world whose collective timeout is `pg_timeout_s`, while rank 0 spends `rank0_phase_s` (several
times longer) waiting for its batch, "evaluating" and "pushing weights": a cluster job's 30-minute
first batch against a 10-minute NCCL timeout, shrunk to seconds. Rank 0 prints RESULT lines.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

from megatron_sao.megatron.cpu_compat import ensure_cpu_compat  # noqa: E402

torch.set_num_threads(1)
ensure_cpu_compat()

from megatron_sao.megatron.parallel import init_parallel  # noqa: E402
from megatron_sao.models.parallel_sizes import ParallelSizes  # noqa: E402
from megatron_sao.trainer.loop import SAOTrainer  # noqa: E402

tmp, pg_timeout_s, phase_s = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
# The rendezvous also runs under the group's timeout: start it only once both ranks have imported
# everything (a loaded 2-core machine can take longer than pg_timeout_s to import megatron-core).
(tmp / f"ready-{os.environ['RANK']}").touch()
while len(list(tmp.glob("ready-*"))) < 2:
    time.sleep(0.05)
torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=pg_timeout_s))
ctx = init_parallel(ParallelSizes(), timeout_s=pg_timeout_s)


class SlowBuffer:
    """Rank 0's buffer: the first batch takes `phase_s` to arrive (long rollouts)."""

    def take(self, step, version, timeout=None, should_stop=None):
        time.sleep(phase_s)
        return [f"trajectory-{i}" for i in range(4)]


t = SAOTrainer.__new__(SAOTrainer)  # the helpers need these attributes, not models
t.ctx, t.rank0, t.step, t.version, t.wait_s, t._stop_requested = ctx, ctx.rank == 0, 0, 0, 0.0, False
t.cfg = SimpleNamespace(rollout=SimpleNamespace(timeout_s=10 * phase_s), buffer=SimpleNamespace(batch_size=4))
t.buffer = SlowBuffer() if t.rank0 else None
t.driver = SimpleNamespace(error=None, finished=0, failed=0, in_flight=[])
t.colocated = None  # not the colocated placement: no rollout phase before the batch

out = {}
t0 = time.monotonic()
batch = t._next_batch()  # rank 0: phase_s in buffer.take; rank 1: waits for the broadcast
out["batch"] = batch
out["batch_wait_s"] = time.monotonic() - t0

t0 = time.monotonic()
if t.rank0:
    time.sleep(phase_s)  # eval / weight push on rank 0 only
out["stop"] = t._stop_agreed()
out["stop_wait_s"] = time.monotonic() - t0

t0 = time.monotonic()
if t.rank0:
    time.sleep(phase_s)  # the rollout engines start on rank 0 only
t._barrier()
out["barrier_wait_s"] = time.monotonic() - t0

gathered = [None, None]
torch.distributed.all_gather_object(gathered, out)
if t.rank0:
    print("RESULT " + json.dumps({"ranks": gathered, "pg_timeout_s": ctx.timeout_s}), flush=True)
    print("RANK0_WAIT DONE", flush=True)
