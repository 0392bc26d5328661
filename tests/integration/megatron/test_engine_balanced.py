"""The balanced, budgeted batch plan on 2 gloo ranks at EP 2 (tiny Qwen3-MoE), against the contiguous
rule it replaced, with both MoE token dispatchers: allgather (the CPU build's default) and alltoall (the
GPU path's, run here on gloo through an override). One launch, workers/engine_balanced.py."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.integration.megatron.result_lines import parse_tagged
from tests.launch import torchrun_cmd
from tests.paths import REPO

WORKER = "tests.integration.megatron.workers.engine_balanced"
DISPATCHERS = ["allgather", "alltoall"]
# A rank that ran one forward more than its EP peer would wait in the dispatcher's collective forever;
# the launch's timeout turns such a hang into a failure instead of a blocked CI job.
HANG_TIMEOUT_S = 400

pytestmark = pytest.mark.slow  # a torchrun launch of 2 ranks


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = torchrun_cmd(2, "-m", WORKER, str(tmp_path_factory.mktemp("engine_balanced")), *DISPATCHERS)
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the EP=2 launch did not finish in {HANG_TIMEOUT_S} s (a rank waiting in a collective its "
                    f"peer never entered?)\n{(e.stdout or b'')[-3000:]!r}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "ENGINE_BALANCED DONE" in proc.stdout
    return parse_tagged(proc.stdout)


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_balanced_budgeted_split_has_the_gradients_of_the_contiguous_split(results, dispatcher):
    r = results[dispatcher]
    assert r["n_grads"] > 10 and r["actor_grad_max"] > 1e-3  # real gradients were compared
    assert r["actor_grad_diff"] <= 1e-6 and r["critic_grad_diff"] <= 1e-6, r
    assert r["actor_loss_diff"] <= 1e-6 and r["critic_loss_diff"] <= 1e-6, r
    # outputs come back in the batch's order whatever rank computed a row
    assert r["logprobs_diff"] <= 1e-5 and r["values_diff"] <= 1e-5, r
    # and the split really was different: the old one padded micro-batch i to the same width on both ranks
    assert r["contiguous_widths"][0] == r["contiguous_widths"][1]
    assert r["balanced_widths"] != r["contiguous_widths"]
    # the step reports how well each plan spread the batch: the balanced one pads less
    old, new = r["plan_metrics"]["contiguous"], r["plan_metrics"]["balanced"]
    assert new["plan/padding_fraction"] < old["plan/padding_fraction"]
    assert new["plan/forward_calls"] == max(r["balanced_calls"])


def test_ep_ranks_with_unequal_rows_run_the_same_number_of_forwards(results):
    for dispatcher in DISPATCHERS:
        r = results[dispatcher]
        assert r["rows_per_rank"][0] != r["rows_per_rank"][1]
        # left to itself each rank would cut a different number of micro-batches
        assert r["calls_without_equal_count"][0] != r["calls_without_equal_count"][1]
        assert r["balanced_calls"][0] == r["balanced_calls"][1], r
    # alltoall: each rank pads only to its own rows; allgather: one shape per micro-batch on both ranks
    assert results["alltoall"]["balanced_widths"][0] != results["alltoall"]["balanced_widths"][1]
    assert results["allgather"]["balanced_widths"][0] == results["allgather"]["balanced_widths"][1]
