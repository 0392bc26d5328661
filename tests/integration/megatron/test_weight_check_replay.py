"""The weight-sync check replays the engines' routes under routing replay (workers/weight_check_replay.py).

Engines with the actor's weights that route otherwise (their routers take other experts): the check's
mismatch is routing, not transfer. With replay it falls to float round-off, for the in-process engine
and the HTTP client alike; without replay (what the check did before: a free-routing reference) it is
large and the check fails; with replay a real transfer error still fails the check.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.integration.megatron.result_lines import parse_tagged
from tests.launch import torchrun_cmd
from tests.paths import REPO

WORKER = "tests.integration.megatron.workers.weight_check_replay"

pytestmark = pytest.mark.slow  # one torchrun launch of 2 ranks


@pytest.fixture(scope="module")
def everyone(tmp_path_factory):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = torchrun_cmd(2, "-m", WORKER, str(tmp_path_factory.mktemp("weight_check_replay")))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "WEIGHT CHECK REPLAY DONE" in proc.stdout
    return parse_tagged(proc.stdout)


@pytest.fixture(scope="module")
def results(everyone):
    """Rank 0's results (it holds the rollout side)."""
    return {k.removesuffix("_rank0"): v for k, v in everyone.items() if k.endswith("_rank0")}


def test_every_rank_ran_the_replayed_forward_and_stopped_alike(everyone):
    """Rank 1 joined each replayed check's forward (its routers counted routes) and learnt each outcome."""
    for tag in ("replay_on", "replay_off_measured", "replay_off", "corrupt_on"):
        r0, r1 = everyone[f"{tag}_rank0"], everyone[f"{tag}_rank1"]
        assert ("error" in r0) == ("error" in r1), (tag, r0, r1)
        assert r0.get("moe/routing_agreement_used") == r1.get("moe/routing_agreement_used"), (tag, r0, r1)


def test_replayed_check_passes_at_round_off_on_every_placement_engine(results):
    r = results["replay_on"]
    assert "error" not in r, r
    assert set(r["diff"]) == {"embedded", "http"} and max(r["diff"].values()) <= 1e-5, r
    # the reference forward used the engines' routes, which are not the actor's own
    assert r["moe/routing_agreement_used"] == 1.0 and r["moe/routing_agreement"] < 0.5, r


def test_free_routing_reference_measures_routing_not_transfer(results):
    measured = results["replay_off_measured"]
    assert min(measured["diff"].values()) > 0.1, measured
    assert "moe/routing_agreement" not in measured  # no routes in that forward
    assert "weight check failed" in results["replay_off"]["error"], results["replay_off"]


def test_replayed_check_still_catches_a_corrupted_transfer(results):
    r = results["corrupt_on"]
    assert "weight check failed" in r.get("error", ""), r
    assert r["moe/routing_agreement_used"] == 1.0, r
