"""The weight-sync check replays the engines' routes under routing replay (workers/weight_check_replay.py).

Engines with the actor's weights that route otherwise (their routers take other experts): the check's
mismatch is routing, not transfer. With replay it falls to float round-off, for the in-process engine
and the HTTP client alike; without replay (what the check did before: a free-routing reference) it is
large and the check fails; with replay a real transfer error still fails the check.
"""

from __future__ import annotations

import os

import pytest
from result_lines import run_worker

WORKER = os.path.join(os.path.dirname(__file__), "workers", "weight_check_replay.py")

pytestmark = pytest.mark.slow  # one Megatron worker process


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_worker(WORKER, str(tmp_path_factory.mktemp("weight_check_replay")), done="WEIGHT CHECK REPLAY DONE")


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
