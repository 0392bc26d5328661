"""kill -9 at every moment that matters, then `sao train --resume`: nothing trained twice, nothing lost.

The trainer is a real subprocess killed by its own fault hook (megatron_sao/faults.py, SAO_FAULT) at
exact points of the real code: before the first checkpoint, mid-step, mid-checkpoint write, while an
asynchronous checkpoint's writers run, right after the commit (before the buffer release), mid-rollout.
Each test chains the kills in one run directory, each resume starting from what the previous kill left,
and then checks batches.jsonl.
"""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.e2e_util import CONFIG, ENV, sao

pytestmark = pytest.mark.slow


def rows(run, name):
    return [json.loads(line) for line in (Path(run) / name).read_text().splitlines()]


def killed_at(fault, *args):
    """Run `sao train` with SAO_FAULT=fault and check that it died by SIGKILL at that point."""
    p = subprocess.run([sys.executable, "-m", "megatron_sao.cli", "train", CONFIG, *args],
                       env={**ENV, "SAO_FAULT": fault}, capture_output=True, text=True, timeout=600)
    assert p.returncode == -signal.SIGKILL, f"{fault}: exit {p.returncode}\n{p.stderr[-3000:]}"
    return p


def test_replay_run_killed_at_every_moment_equals_an_uninterrupted_one(tmp_path, replay_file):
    # Synchronous saves, so that each kill below lands where its comment says; the asynchronous kill is
    # the one link that turns them on.
    common = [f"trainer.replay={replay_file}", "algorithm.critic_warmup_steps=1", "run.total_steps=5",
              "run.save_every=1", "run.console=none", "run.async_save=false"]
    full, run = tmp_path / "full", tmp_path / "killed"
    sao("train", CONFIG, f"run.dir={full}", *common)
    at = [f"run.dir={run}", *common]

    killed_at("batch_logged:1", *at)  # step 0 logged, no checkpoint yet
    assert not (run / "checkpoints" / "latest").exists() and len(rows(run, "metrics.jsonl")) == 1
    # --resume without a checkpoint starts over cleanly; killed right after the 2nd commit, before
    # the release of step 0's trajectory files.
    killed_at("checkpoint_committed:2", *at, "--resume")
    assert (run / "checkpoints" / "latest").read_text() == "step_000002"
    assert len(list((run / "buffer").glob("*.safetensors"))) == 64  # nothing released yet
    killed_at("checkpoint_parts_written:1", *at, "--resume")  # step 2 trained, checkpoint 3 half-done
    assert list((run / "checkpoints").glob("step_000003.tmp-*"))
    (run / "buffer" / "000000999-0123abcd.safetensors.tmp-1-cafe").write_bytes(b"half a file")  # a kill mid-write
    killed_at("batch_taken:2", *at, "--resume")  # checkpoint 3 written, step 3's batch taken
    assert not list((run / "checkpoints").glob("step_000003.tmp-*"))
    assert not list((run / "buffer").glob("*.tmp-*"))
    killed_at("batch_logged:2", *at, "--resume")  # step 3 and checkpoint 4, step 4 logged, no checkpoint 5
    assert (run / "checkpoints" / "latest").read_text() == "step_000004"
    # kill -9 while an asynchronous checkpoint (5) is being written: the trainer is gone before any commit
    killed_at("checkpoint_save_scheduled:1", *at, "--resume", "run.async_save=true")
    assert (run / "checkpoints" / "latest").read_text() == "step_000004"

    # The latest checkpoint is damaged (the actor's index, same size): its load fails, resume falls back to
    # step_000003 and names the directory.
    index = run / "checkpoints" / "step_000004" / "actor" / ".metadata"
    data = bytearray(index.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)
    index.write_bytes(bytes(data))
    p = sao("train", CONFIG, *at, "--resume")
    assert "step_000004 is damaged" in p.stderr and str(index.parent) in p.stderr, p.stderr[-3000:]
    assert "resuming from step_000003" in p.stderr
    assert (run / "checkpoints" / "step_000004.damaged").is_dir()

    a, b = rows(full, "metrics.jsonl"), rows(run, "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(6))  # each step logged once
    assert [x["traj_ids"] for x in rows(run, "batches.jsonl")] == [x["traj_ids"] for x in rows(full, "batches.jsonl")]
    trained = [t for x in rows(run, "batches.jsonl") for t in x["traj_ids"]]
    assert len(trained) == len(set(trained)) == 48  # every trajectory exactly once
    for ra, rb in zip(a, b):
        for key in ("critic/loss", "actor/loss", "actor/kept_fraction"):
            if key in ra:
                assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), (ra["step"], key)


def test_rollout_run_killed_mid_rollout_and_after_a_commit_trains_every_prompt_once(tmp_path):
    run = tmp_path / "rollout"
    at = [f"run.dir={run}", "run.total_steps=4", "run.save_every=1", "algorithm.critic_warmup_steps=0",
          "buffer.staleness_policy=keep", "buffer.max_staleness=2", "run.console=none"]
    killed_at("buffer_put:20", *at)  # mid-rollout: the 20th finished trajectory was just written
    killed_at("checkpoint_committed:2", *at, "--resume")  # right after a commit, before the release
    on_disk = {p.name.split("-", 1)[1].split(".")[0] for p in (run / "buffer").glob("*.safetensors")}
    sao("train", CONFIG, *at, "--resume")
    batches = rows(run, "batches.jsonl")
    assert [b["step"] for b in batches] == [0, 1, 2, 3]
    prompts = [p for b in batches for p in b["prompt_ids"]]
    assert len(prompts) == len(set(prompts)) == 32, sorted(prompts)  # no prompt trained twice
    trajs = [t for b in batches for t in b["traj_ids"]]
    assert len(trajs) == len(set(trajs))
    still_there = {p.name.split("-", 1)[1].split(".")[0] for p in (run / "buffer").glob("*.safetensors")}
    set_aside = {p.name.split("-", 1)[1].split(".")[0] for p in (run / "buffer" / "set_aside").glob("*.safetensors")}
    # Every trajectory that had finished was trained, is kept, or was set aside (sampled after the
    # checkpoint by a policy the resumed run does not have: its prompt ran again, trained once above).
    assert on_disk <= set(trajs) | still_there | set_aside


def test_a_run_resumed_steps_after_its_checkpoint_keeps_the_staleness_bound(tmp_path):
    """Killed two steps after its last checkpoint, an asynchronous run left a buffer full of trajectories:
    those the killed attempt had already trained on (not covered by the checkpoint) and those it had
    sampled ahead. The resumed run counts them against admission, so it does not run ahead by that many
    more batches (uncounted, they raise the lag to 4-6 versions here under buffer.max_staleness=1 with a
    buffer that keeps stale data); and the ones a policy newer than the checkpoint's sampled are set
    aside, their prompts run again: that policy is gone, and their version labels would collide with the
    resumed run's."""
    run = tmp_path / "lag"
    at = [f"run.dir={run}", "run.total_steps=10", "run.save_every=2", "buffer.staleness_policy=keep",
          "buffer.max_staleness=1", "run.console=none"]
    killed_at("batch_taken:7", *at)  # steps 0-5 trained, the checkpoint of step 4 committed
    sao("train", CONFIG, *at, "--resume")
    metrics = rows(run, "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(11))
    lags = {m["step"]: sorted(int(lag) for lag in m["lag_histogram"]) for m in metrics}
    assert max(max(v) for v in lags.values()) <= 1, lags
    aside = list((run / "buffer" / "set_aside").glob("*.safetensors"))
    assert aside, "the killed attempt's steps 4-5 sampled with policy versions the resumed run does not have"
    prompts = [p for b in rows(run, "batches.jsonl") for p in b["prompt_ids"]]
    assert len(prompts) == len(set(prompts)) == 11 * 8  # no prompt trained twice, none lost
