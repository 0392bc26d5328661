"""Two ranks, a tiny process-group timeout, and rank-0-only phases longer than it.

Usage: torchrun --nproc_per_node 2 -m tests.integration.megatron.workers.rank0_wait <tmp_dir> <pg_timeout_s>
  <rank0_phase_s>

Drives the trainer's own pieces (the placement's batch wait then the gated broadcast, as
SAOTrainer._next_batch does; the stop agreement; the barrier: distributed/gated.py) on a real gloo
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

from megatron_sao.megatron.cpu_compat import ensure_cpu_compat

torch.set_num_threads(1)
ensure_cpu_compat()

from megatron_sao.distributed.gated import GatedCollectives  # noqa: E402
from megatron_sao.megatron.parallel import init_parallel  # noqa: E402
from megatron_sao.models.parallel_sizes import ParallelSizes  # noqa: E402
from megatron_sao.trainer.placement import Placement  # noqa: E402

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


rank0 = ctx.rank == 0
collectives = GatedCollectives(ctx)
buffer = SlowBuffer() if rank0 else None
placement = Placement(SimpleNamespace())  # not the colocated placement: no rollout phase before the batch

out = {}
t0 = time.monotonic()
# rank 0: phase_s in buffer.take; rank 1: waits for the broadcast (SAOTrainer._next_batch)
take = (lambda timeout: buffer.take(0, 0, timeout=timeout)) if rank0 else None
batch = collectives.broadcast(placement.wait_for_batch(0, take, lambda: False, 10 * phase_s))
out["batch"] = batch
out["batch_wait_s"] = time.monotonic() - t0

t0 = time.monotonic()
if rank0:
    time.sleep(phase_s)  # eval / weight push on rank 0 only
out["stop"] = collectives.any_rank(False, "the stop agreement")
out["stop_wait_s"] = time.monotonic() - t0

t0 = time.monotonic()
if rank0:
    time.sleep(phase_s)  # the rollout engines start on rank 0 only
collectives.barrier()
out["barrier_wait_s"] = time.monotonic() - t0

gathered = [None, None]
torch.distributed.all_gather_object(gathered, out)
if rank0:
    print("RESULT " + json.dumps({"ranks": gathered, "pg_timeout_s": ctx.timeout_s}), flush=True)
    print("RANK0_WAIT DONE", flush=True)
