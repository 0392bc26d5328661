"""Rank-0-only phases longer than the process-group timeout do not kill a multi-rank job.

A cluster job's ranks 1..N used to wait for rank 0's first batch (up to rollout.timeout_s = 1800 s)
inside a broadcast, under a 600 s NCCL timeout. Here: 2 gloo ranks, a 2 s collective timeout and
rank-0-only phases of 7 s each (batch wait, eval/weight push before the stop agreement, rollout
start before a barrier).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.integration.megatron.result_lines import parse_untagged
from tests.launch import torchrun_cmd
from tests.paths import REPO

WORKER = "tests.integration.megatron.workers.rank0_wait"
PG_TIMEOUT_S, PHASE_S = 2.0, 7.0


@pytest.mark.slow
def test_other_ranks_outwait_a_rank0_phase_longer_than_the_collective_timeout(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = torchrun_cmd(2, "-m", WORKER, str(tmp_path), str(PG_TIMEOUT_S), str(PHASE_S))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "RANK0_WAIT DONE" in proc.stdout
    res = parse_untagged(proc.stdout)[0]
    assert res["pg_timeout_s"] == PG_TIMEOUT_S
    for r in res["ranks"]:
        assert r["batch"] == [f"trajectory-{i}" for i in range(4)]  # rank 1 got rank 0's batch
        assert r["stop"] is False
    rank1 = res["ranks"][1]
    # rank 1 really waited through each phase, far longer than a collective may take
    for key in ("batch_wait_s", "stop_wait_s", "barrier_wait_s"):
        assert rank1[key] >= PHASE_S - 0.5 > 3 * PG_TIMEOUT_S, rank1
