"""Distributed checkpoints reshard: saved at TP 2 + EP 2 + SP (asynchronously, actor and critic in flight
together while both train on), at PP 2 and at DP 2 (distributed optimizer), each resumed at TP 1 / EP 1 /
DP 1 (one rank, plain optimizer); the TP 2 + EP 2 one also at DP 2 (the distributed optimizer, over the ranks
that held TP and EP shards), the PP 2 one at TP 2 with the experts split over TP (ETP 2). The worker is
tests/integration/megatron/workers/dist_checkpoint.py: two launches, one of two ranks that saves, one of one rank that
resumes."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.integration.megatron.result_lines import parse_tagged
from tests.launch import torchrun_cmd
from tests.paths import REPO

WORKER = "tests.integration.megatron.workers.dist_checkpoint"
LOSS_TOL = 1e-5  # fp32: the same steps at another layout reduce in another order

pytestmark = pytest.mark.slow  # torchrun launches of 2 and 1 ranks


def _launch(tmp, nproc: int, phase: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(torchrun_cmd(nproc, "-m", WORKER, str(tmp), phase), cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "DIST_CHECKPOINT DONE" in proc.stdout
    return parse_tagged(proc.stdout)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist_checkpoint")
    saved = _launch(tmp, 2, "save")
    return {**saved, **_launch(tmp, 1, "resume")}


def _same_state(tensors: dict) -> None:
    """The re-saved checkpoint (loaded at the new layout, saved again) holds every tensor of the original,
    model and optimizer (fp32 main weight, both moments of every trainable tensor), bit for bit."""
    assert tensors["only_original"] == [] and tensors["only_resaved"] == [], tensors
    assert tensors["optimizer_keys"] > 0 and tensors["max_abs_diff"] == 0.0, tensors


@pytest.mark.parametrize("source", ["tp2sp_ep2", "pp2", "dp2"])
def test_resumed_at_tp1_holds_the_same_state_and_continues_the_losses(results, source):
    r = results[f"{source}_at_tp1"]
    for role, got in r.items():
        assert got["saved_layout"]["world_size"] == 2 and got["optimizer"] == ["FP32Optimizer"], got
        assert got["state_version"] == 1
        _same_state(got["tensors"])
        # the steps after the resume are those of a run that never left TP 1
        assert got["losses"] == pytest.approx(got["reference"], abs=LOSS_TOL, rel=0), (role, got)
    actor = r["actor"]["tensors"]
    assert actor["optimizer_keys"] == 3 * (actor["keys"] - actor["optimizer_keys"])  # every actor tensor trains


def test_tp2_ep2_resumed_at_dp2_with_the_distributed_optimizer(results):
    r = results["tp2sp_ep2_at_dp2"]
    assert r["actor"]["saved_layout"]["distributed_optimizer"] is False
    assert r["actor"]["optimizer"] == ["DistributedOptimizer"]
    assert r["actor"]["losses"] == pytest.approx(r["actor"]["reference"], abs=LOSS_TOL, rel=0)
    assert r["critic"]["losses"] == pytest.approx(results["tp2sp_ep2_at_tp1"]["critic"]["reference"], abs=LOSS_TOL,
                                                  rel=0)
    for role in ("actor", "critic"):
        _same_state(results[f"tp2sp_ep2_at_dp2_tensors_{role}"])


def test_pp2_resumed_at_tp2_with_experts_split_over_tp(results):
    r = results["pp2_at_tp2sp"]["actor"]
    assert r["saved_layout"]["pp"] == 2 and r["saved_layout"]["etp"] == 1
    assert r["losses"] == pytest.approx(results["pp2_at_tp1"]["actor"]["reference"], abs=LOSS_TOL, rel=0)
    _same_state(results["pp2_at_tp2sp_tensors_actor"])


def test_an_old_per_rank_checkpoint_resumes_at_its_own_layout(results):
    r = results["old_format_same_layout"]
    assert r["twin"] == r["original"]
