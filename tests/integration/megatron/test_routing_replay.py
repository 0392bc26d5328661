"""Rollout routing replay through the Megatron actor on 2 gloo ranks: EP=2 (the issue's check), TP=2+SP+EP=2,
PP=2 and DP=2, in one launch (workers/routing_replay.py)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.integration.megatron.result_lines import parse_tagged
from tests.launch import torchrun_cmd
from tests.paths import REPO

WORKER = "tests.integration.megatron.workers.routing_replay"
LAYOUTS = ["ep2", "tp2sp_ep2", "pp2", "dp2"]

pytestmark = pytest.mark.slow  # one torchrun launch of 2 ranks


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = torchrun_cmd(2, "-m", WORKER, str(tmp_path_factory.mktemp("routing_replay")), *LAYOUTS)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "ROUTING_REPLAY DONE" in proc.stdout
    return parse_tagged(proc.stdout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_replayed_routes_are_the_ones_used(results, layout):
    """Replayed routes (not the model's own) give the log-probs of the HF model with those experts forced,
    not those of free routing; the step's loss is the forced model's NLL."""
    r = results[layout]
    assert r["hf_forced_vs_free"] > 0.1, r  # the forced routes change the outputs: the check can fail
    assert r["forced_vs_hf_forced"] <= 1e-5, r
    assert r["forced_vs_hf_free"] > 0.1, r
    assert r["train_loss_vs_hf_forced"] <= 1e-5, r


@pytest.mark.parametrize("layout", LAYOUTS)
def test_agreement_metric(results, layout):
    """The trainer's own routing equals the HF model's (fp32 both): agreement 1.0 measured with replay off,
    and with it the outputs of free routing; random routes agree on a small share, replayed or not."""
    r = results[layout]
    assert r["own_agreement_replay_off"] == 1.0, r
    assert r["own_measure_vs_hf_free"] <= 1e-5 and r["forced_measure_vs_hf_free"] <= 1e-5, r
    assert r["forced_agreement_replay_off"] < 0.5 and r["forced_agreement_replay_on"] < 0.5, r
    assert r["train_agreement"] == r["forced_agreement_replay_on"], r
    # the routes the forward used: the engine's with replay on, the trainer's own with it off
    assert r["forced_used_replay_on"] == 1.0 and r["train_used"] == 1.0, r
    assert r["forced_used_replay_off"] == r["forced_agreement_replay_off"], r


def test_a_pipeline_stage_without_routers_joins_the_agreement(results):
    """PP=2 with the second stage's routers gone (dense layers there): its ranks still take the batch's
    routes and join the agreement's all-reduce, which the first stage's routers make (it hung before);
    the trainer's own routes agree on every token of the first stage's layers."""
    assert results["pp2"]["agreement_with_a_routerless_stage"] == 1.0, results["pp2"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_recompute_replays_the_same_routes(results, layout):
    """Full activation recompute re-runs every forward in the backward pass (counted) and replays the routes
    the forward used: the same loss and gradient norm as without recompute."""
    r = results[layout]
    micro_batches = 2 if "dp 0/2" in r["ctx"] else 3  # 5 rows, micro-batch 2 (DP=2: 3 rows per rank -> 2)
    assert r["recomputed_forwards"] == r["local_routers"] * micro_batches, r
    assert r["recompute_loss_diff"] <= 1e-6 and r["recompute_grad_norm_diff"] <= 1e-6, r


@pytest.mark.parametrize("layout", LAYOUTS)
def test_targets_are_held_only_for_forwards_that_recompute_reruns(results, layout):
    """Without recompute a router keeps one micro-batch's int64 targets (Megatron's backward list would
    keep every one to the end of the schedule: 8 bytes per token x layer x topk); with it, the forwards
    whose backward has not run yet (1F1B: at most the pipeline depth)."""
    r = results[layout]
    assert r["held_targets_max_no_recompute"] == 1, r
    assert 1 <= r["held_targets_max_recompute"] <= (2 if layout == "pp2" else 1), r
