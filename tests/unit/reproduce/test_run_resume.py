"""A checkpointing run (`Run.checkpoint_every`) that an earlier invocation left unfinished is resumed
with `--resume`, its attempts' wall and CPU time added; any other half-finished run starts over.
The stage is a stand-in script at the subprocess boundary (the trainer's own resume is tested with
the trainer: tests/unit/test_checkpoints.py, tests/integration)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from benchmarks.reproduce import runner
from benchmarks.reproduce.runner import Run

# The stand-in for `sao train`: the first attempt burns about 0.4 CPU s in a grandchild it waits for
# (as torchrun's ranks are), checkpoints, and dies by SIGKILL; a resumed one (--resume) finishes.
STAGE = """
import os, signal, subprocess, sys, time
from pathlib import Path
d = Path(next(a for a in sys.argv if a.startswith("run.dir=")).split("=", 1)[1])
print("argv", " ".join(sys.argv[1:]), flush=True)
if "--resume" in sys.argv:
    (d / "final_model").mkdir()
    (d / "final_model" / "config.json").write_text("{}")
    sys.exit(0)
subprocess.run([sys.executable, "-c",
                "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.4: pass"])
(d / "checkpoints").mkdir()
time.sleep(float(os.environ.get("STAGE_HOLD_S", "0")))
os.kill(os.getpid(), signal.SIGKILL)
"""


def _stage(tmp_path, monkeypatch):
    script = tmp_path / "stage.py"
    script.write_text(STAGE)
    monkeypatch.setattr(runner, "stage_command",
                        lambda run, d, resume: [sys.executable, str(script), f"run.dir={d}",
                                                *run.command_overrides(), *(["--resume"] if resume else [])])
    monkeypatch.setattr(runner, "LOAD_SAMPLE_S", 0.1)


def test_an_interrupted_checkpointing_run_resumes_and_counts_every_attempt(tmp_path, monkeypatch):
    _stage(tmp_path, monkeypatch)
    run = Run("sao", 1, "examples/tiny_cpu.yaml", ("run.save_every=0", "run.total_steps=3"), checkpoint_every=10)
    first = runner.execute(run, tmp_path / "work", log=lambda *_: None)
    assert not first.ok and first.attempts == 1 and first.cpu_s >= 0.4
    d = first.dir
    (tried,) = json.loads((d / "reproduce_train.attempts.json").read_text())
    assert tried["exit"] == -9 and tried["load_samples"] >= 1

    second = runner.execute(run, tmp_path / "work", log=lambda *_: None)
    assert second.ok and second.dir == d and second.attempts == 2
    log = (d / "train.log").read_text().splitlines()  # appended to, not replaced
    assert ["--resume" in line.split() for line in log] == [False, True], log
    assert "run.save_every=10" in log[0] and "run.save_every=0" not in log[0]  # checkpoints, key unchanged
    tries = json.loads((d / "reproduce_train.attempts.json").read_text())
    assert [a["exit"] for a in tries] == [-9, 0]
    assert second.wall_s == sum(a["wall_s"] for a in tries) and second.cpu_s >= 0.4
    assert not (d / "checkpoints").exists()  # finished: optimizer state is not kept
    info = json.loads((d / "reproduce_train.json").read_text())
    assert info["attempts"] == 2 and info["t_start"] == tries[0]["t_start"]

    cached = runner.execute(run, tmp_path / "work", log=lambda *_: None)
    assert cached.cached and cached.attempts == 2 and cached.wall_s == second.wall_s


def test_a_run_that_does_not_checkpoint_starts_over(tmp_path, monkeypatch):
    _stage(tmp_path, monkeypatch)
    run = Run("grpo", 1, "examples/tiny_cpu.yaml", ("run.save_every=0",))
    first = runner.execute(run, tmp_path / "work", log=lambda *_: None)
    assert not first.ok and not (first.dir / "reproduce_train.attempts.json").exists()
    again = runner.execute(run, tmp_path / "work", log=lambda *_: None)
    assert not again.ok and again.attempts == 1  # no --resume: the same first attempt again
    assert "--resume" not in (again.dir / "train.log").read_text()


def test_a_running_attempt_records_what_it_has_cost_so_far(tmp_path, monkeypatch):
    """The record a session's kill leaves behind: written while the attempt runs, its exit unknown."""
    _stage(tmp_path, monkeypatch)
    monkeypatch.setenv("STAGE_HOLD_S", "1.5")
    run = Run("sao", 2, "examples/tiny_cpu.yaml", (), checkpoint_every=10)
    record = run.directory(tmp_path / "work") / "reproduce_train.attempts.json"
    worker = threading.Thread(target=runner.execute, args=(run, tmp_path / "work"), kwargs={"log": lambda *_: None})
    worker.start()
    seen = None
    while worker.is_alive() and seen is None:
        time.sleep(0.05)
        if (run.directory(tmp_path / "work") / "checkpoints").exists() and record.exists():
            (last,) = json.loads(record.read_text())
            if last["exit"] is None and last["cpu_s"] >= 0.4:
                seen = last
    worker.join()
    assert seen is not None, "no in-flight record counted the grandchild's CPU while the attempt ran"
    assert seen["wall_s"] > 0 and seen["load_samples"] >= 1


def test_elapsed_time_leaves_out_the_gaps_between_attempts(tmp_path):
    run = Run("sao", 1, "examples/tiny_cpu.yaml", checkpoint_every=10)
    d = tmp_path / "r"
    d.mkdir()
    (d / "reproduce_train.attempts.json").write_text(json.dumps([
        {"t_start": 100.0, "wall_s": 50.0}, {"t_start": 1000.0, "wall_s": 30.0}]))
    res = runner.RunResult(run, d, True, 80.0, cached=True)
    assert res.elapsed(120.0) == 20.0  # the first attempt
    assert res.elapsed(1010.0) == 60.0  # the second: 50 s of the first before it, not the 850 s gap
    assert res.elapsed(155.0) == 55.0  # logged just after the first attempt's last sample: still its own


def test_checkpointing_is_not_part_of_a_runs_key():
    plain = Run("sao", 1, "examples/tiny_cpu.yaml", ("run.save_every=0",))
    assert Run("sao", 1, "examples/tiny_cpu.yaml", ("run.save_every=0",), checkpoint_every=10).key() == plain.key()
    assert plain.command_overrides() == ("run.save_every=0",)


def test_an_attempt_that_outlived_its_harness_is_not_run_over(tmp_path, monkeypatch):
    """A stage process still training in the directory (its harness killed, it not): the next
    invocation names it instead of starting a second trainer on the same checkpoints."""
    _stage(tmp_path, monkeypatch)
    run = Run("sao", 3, "examples/tiny_cpu.yaml", (), checkpoint_every=10)
    d = run.directory(tmp_path / "work")
    d.mkdir(parents=True)
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"run.dir={d}"])
    cmdline = Path(f"/proc/{orphan.pid}/cmdline")
    deadline = time.monotonic() + 10  # until the child has exec'd (before, /proc shows pytest's cmdline)
    while f"run.dir={d}".encode() not in cmdline.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        (d / "reproduce_train.attempts.json").write_text(json.dumps([
            {"pid": orphan.pid, "t_start": time.time(), "wall_s": 1.0, "cpu_s": 0.5, "load_samples": 1,
             "load_avg": 1.0, "exit": None}]))
        with pytest.raises(RuntimeError, match=f"pid {orphan.pid}\\) is still training"):
            runner.execute(run, tmp_path / "work", log=lambda *_: None)
    finally:
        orphan.kill()
        orphan.wait()
    resumed = runner.execute(run, tmp_path / "work", log=lambda *_: None)  # once it is gone: resumed
    assert resumed.ok and resumed.attempts == 2
