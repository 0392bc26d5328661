"""run.export_every's HF export on a real engine (workers/periodic_export.py, one subprocess:
ensure_cpu_compat patches torch process-wide), and the actor step's entropy against the HF model."""

from __future__ import annotations

import pytest

from tests.integration.megatron.result_lines import run_worker

WORKER = "tests.integration.megatron.workers.periodic_export"

pytestmark = pytest.mark.slow  # one Megatron worker subprocess for all the tests


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_worker(WORKER, str(tmp_path_factory.mktemp("export")), done="EXPORT DONE")


@pytest.mark.parametrize("step", [1, 2, 3])
def test_each_export_loads_in_transformers_with_the_actors_logprobs(results, step):
    r = results[f"step{step}"]
    assert r["max_abs_diff"] < 1e-4, r
    assert r["moved_from_base"] > 1e-3, r  # the export holds the trained weights, not the base model's


def test_the_newest_two_exports_are_kept(results):
    assert results["step1"]["kept"] == ["step_000001"]
    assert results["step2"]["kept"] == ["step_000001", "step_000002"]
    assert results["step3"]["kept"] == ["step_000002", "step_000003"]


def test_an_export_that_fails_mid_stream_leaves_nothing_behind(results):
    r = results["failed"]
    assert r["error"] == "rank lost mid-export"
    assert r["left"] == ["step_000002", "step_000003"]  # no step_000004, no temp directory


@pytest.mark.parametrize("step", [1, 2, 3])
def test_the_actor_steps_entropy_is_the_full_softmax_entropy_over_action_tokens(results, step):
    r = results[f"step{step}"]
    assert r["entropy"] == pytest.approx(r["hf_entropy"], abs=1e-4), r
