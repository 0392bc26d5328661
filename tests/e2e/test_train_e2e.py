"""`sao train` end to end on the CPU: sync and async modes, staleness, TP=2 parity, Ctrl-C.

Resume after kill -9 at every moment: test_resume_kills.py."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.e2e_util import CONFIG, ENV, sao

pytestmark = pytest.mark.slow  # each test runs `sao` (and torchrun) subprocesses


def metrics(run):
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def batches(run):
    return [json.loads(line) for line in (Path(run) / "batches.jsonl").read_text().splitlines()]


def test_policy_lag_makes_every_trajectory_exactly_that_stale(tmp_path):
    """trainer.policy_lag (staleness stress test): the engine holds the weights of L steps ago, so in
    sync mode every trajectory after the first L steps is exactly L versions old."""
    run = tmp_path / "lag"
    sao("train", CONFIG, f"run.dir={run}", "trainer.mode=sync", "run.total_steps=3", "trainer.policy_lag=1",
        "algorithm.critic_warmup_steps=0", "buffer.staleness_policy=keep")
    rows = metrics(run)
    assert [r["version"] for r in rows] == [0, 1, 2]
    assert [r["lag_histogram"] for r in rows] == [{"0": 8}, {"1": 8}, {"1": 8}]
    assert all("logprob_mismatch_lag0" not in r for r in rows[1:])  # no token of the current policy
    # Sync: every episode of step s's batch started after step s-1 finished.
    assert all(r["rollout/policy_step_min"] == r["rollout/policy_step_max"] == r["step"] for r in rows)


def test_sync_mode_trains_on_policy_and_syncs_weights_exactly(tmp_path):
    run = tmp_path / "sync"
    # A head drawn from N(0, 0.02), not the default zero head: the random tiny model earns no reward, so a
    # zero head (bias at the mean return, 0) would see no value error and pass no gradient to the MLPs.
    sao("train", CONFIG, f"run.dir={run}", "trainer.mode=sync", "run.total_steps=2", "critic.value_head_init=normal")
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["version"] for r in rows] == [0, 0, 1]  # step 0 is critic warm-up: the actor waits
    for r in rows:  # sync: every batch was sampled entirely by the current policy
        assert r["lag_histogram"] == {"0": 8}
        for key in ("reward", "critic/loss", "critic/explained_variance", "tokens_per_s",
                    "trainer_idle_fraction", "rollout_idle_fraction", "critic/grad_norm/attention",
                    "critic/grad_norm/moe"):
            assert key in r, key
        assert r["critic/grad_norm/attention"] == 0.0  # frozen attention gets no gradient
        assert r["critic/grad_norm/moe"] > 0.0
    for r in rows[1:]:
        for key in ("actor/kept_fraction", "actor/below_fraction", "actor/above_fraction", "actor/ess"):
            assert key in r, key
        # The trainer's log-probs of tokens the rollout engine sampled at the same policy version:
        # equal up to float32 noise, which checks the weight sync after step 1 and the HF <-> Megatron mapping.
        assert r["logprob_mismatch_lag0"] < 1e-4, r["logprob_mismatch_lag0"]
    seen = [p for b in batches(run) for p in b["prompt_ids"]]
    assert len(seen) == len(set(seen)) == 24  # no prompt trained twice
    positions = []
    for b, r in zip(batches(run), rows, strict=True):  # each trajectory's record, kept past the buffer's pruning
        eps = b["episodes"]
        assert len(eps) == 8 and all(isinstance(e["ending"], str) and e["ending"] for e in eps)
        assert sum(e["reward"] for e in eps) / 8 == pytest.approx(r["reward"])
        assert all(e["first_version"] == r["version"] and e["turns"] >= 1 and e["action_tokens"] > 0 for e in eps)
        positions += [e["pos"] for e in eps]
    assert sorted(positions) == list(range(24))  # sync: step s trains positions [8s, 8s + 8)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000003"
    assert (run / "final_model" / "config.json").exists()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "config.yaml").exists()


def test_async_mode_honours_the_staleness_bound(tmp_path):
    run = tmp_path / "async"
    sao("train", CONFIG, f"run.dir={run}", "run.total_steps=4", "algorithm.critic_warmup_steps=0",
        "buffer.max_staleness=1", "buffer.staleness_policy=drop")
    rows = metrics(run)
    assert [r["version"] for r in rows] == [0, 1, 2, 3]  # the policy version each step started from
    for r in rows:
        assert all(int(lag) <= 1 for lag in r["lag_histogram"]), r["lag_histogram"]
    seen = [t for b in batches(run) for t in b["traj_ids"]]
    assert len(seen) == len(set(seen))


def test_tp2_resumed_at_tp1_gives_the_same_losses_as_one_rank(tmp_path, replay_file):
    """`sao train --resume` on another layout: a TP 2 run of two ranks stops after step 1 (its checkpoint
    written asynchronously, the default); the run resumes on one rank at TP 1 and continues the losses of
    a run that never left TP 1."""
    common = ["trainer.replay=" + str(replay_file), "run.total_steps=2", "algorithm.critic_warmup_steps=1"]
    one, two = tmp_path / "tp1", tmp_path / "tp2"
    sao("train", CONFIG, f"run.dir={one}", *common)
    sao("train", CONFIG, f"run.dir={two}", "parallel.tp=2", "parallel.sequence_parallel=true", *common,
        "run.total_steps=1", torchrun=2)
    p = sao("train", CONFIG, f"run.dir={two}", *common, "--resume")
    assert "(saved at {'tp': 2," in p.stderr, p.stderr[-3000:]
    a, b = metrics(one), metrics(two)
    assert len(a) == len(b) == 3
    for ra, rb in zip(a, b):
        for key in ("critic/loss", "actor/loss", "actor/kept_fraction"):
            if key in ra:
                assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-6), (ra["step"], key)


def test_a_rollout_server_that_never_answers_stops_the_run_with_a_clear_error_and_a_checkpoint(tmp_path):
    run = tmp_path / "dead"
    p = subprocess.run([sys.executable, "-m", "megatron_sao.cli", "train", CONFIG, f"run.dir={run}",
                        "rollout.backend=vllm_server", "rollout.server_urls=[http://127.0.0.1:9]",
                        "rollout.health_check_interval_s=0.5", "rollout.server_start_timeout_s=3"],
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 3, p.stderr[-2000:]
    # it waited rollout.server_start_timeout_s for the server's first /health answer
    assert "rollout servers never answered /health within 3s of the start" in p.stderr
    assert "http://127.0.0.1:9" in p.stderr
    assert (run / "checkpoints" / "latest").exists()  # the episodes it could not run are queued in it


def test_ctrl_c_finishes_the_step_and_writes_a_checkpoint(tmp_path):
    run = tmp_path / "sigint"
    proc = subprocess.Popen([sys.executable, "-m", "megatron_sao.cli", "train", CONFIG, f"run.dir={run}",
                             "run.total_steps=50", "run.console=none"], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if (run / "metrics.jsonl").exists() and len(metrics(run)) >= 1:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]
    assert "checkpoint written" in err
    steps = len(metrics(run))
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{steps:06d}"  # the last finished step


def test_periodic_hf_exports_wandb_and_the_new_actor_metrics(tmp_path, replay_file):
    """run.export_every=1 writes loadable HF checkpoints, the newest two kept, the last one the final
    model; W&B (offline) gets the scalars metrics.jsonl has; every actor step logs its entropy and the
    DIS-masked share of the first turn's tokens."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.scalar_records import history

    run = tmp_path / "exp"
    wb = {k: str(tmp_path / k) for k in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")}
    sao("train", CONFIG, f"run.dir={run}", f"trainer.replay={replay_file}", "run.total_steps=3",
        "algorithm.critic_warmup_steps=0", "run.export_every=1", "run.wandb.project=sao-e2e",
        "run.wandb.mode=offline", "critic.value_head_init=normal", env={**wb, "WANDB_SILENT": "true"})
    assert sorted(p.name for p in (run / "exports").iterdir()) == ["step_000002", "step_000003"]
    last = load_file(run / "exports/step_000003/model.safetensors")
    final = load_file(run / "final_model/model.safetensors")
    assert last.keys() == final.keys() and all(last[k].equal(final[k]) for k in last)
    earlier = load_file(run / "exports/step_000002/model.safetensors")
    # a step apart: the actor moved (the replay's rewards are all 0: only the normal head's non-constant
    # baseline gives the actor an advantage; a zero head's would leave it where it was, as it should)
    assert any(not earlier[k].equal(last[k]) for k in last)
    AutoModelForCausalLM.from_pretrained(run / "exports/step_000002")  # loads as users load it
    rows = metrics(run)
    for r in rows:
        assert r["actor/entropy"] > 0 and r["time/export_s"] > 0
        assert 0.0 <= r["dis/masked_share_turn_0"] <= 1.0
    logged = history(run)
    assert sorted(logged) == [0, 1, 2]
    for r in rows:
        assert logged[r["step"]]["actor/entropy"] == pytest.approx(r["actor/entropy"])
        assert logged[r["step"]]["dis/masked_share_turn_0"] == pytest.approx(r["dis/masked_share_turn_0"])
