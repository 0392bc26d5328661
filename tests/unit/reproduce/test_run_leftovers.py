"""A run's stage process that dies (the kernel's OOM killer, a signal) leaves no process of its own behind:
the runner kills what it started that still runs (a trainer's vLLM engine would otherwise hold its GiBs
through every later run). The stage is a stand-in script at the subprocess boundary."""

from __future__ import annotations

import sys
import time

import psutil

from benchmarks.reproduce import runner
from benchmarks.reproduce.runner import Run

# The stand-in for `sao train`: starts a long-lived child (as the trainer starts its vLLM engine) and one that
# ends half a second after the stage (as multiprocessing's resource tracker cleans up), waits until the runner has
# sampled them (the flag file the test's wrapper of runner._tree writes: a fixed sleep was too short under load),
# and dies by SIGKILL, as the OOM killer kills a trainer.
STAGE = """
import os, signal, subprocess, sys, time
from pathlib import Path
d = Path(next(a for a in sys.argv if a.startswith("run.dir=")).split("=", 1)[1])
flag = sys.argv[-1]
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
tracker = subprocess.Popen([sys.executable, "-c", TRACKER, flag])
(d / "engine.pid").write_text(str(engine.pid))
(d / "tracker.pid").write_text(str(tracker.pid))
deadline = time.monotonic() + 120
while not Path(flag).exists() and time.monotonic() < deadline:
    time.sleep(0.02)
os.kill(os.getpid(), signal.SIGKILL)
"""
TRACKER = """
import pathlib, sys, time
flag = pathlib.Path(sys.argv[1])
deadline = time.monotonic() + 120
while not flag.exists() and time.monotonic() < deadline:
    time.sleep(0.02)
time.sleep(0.5)
"""


def test_a_killed_stage_s_orphaned_child_is_killed_and_named_one_that_ends_by_itself_is_left_to(
        tmp_path, monkeypatch):
    script = tmp_path / "stage.py"
    script.write_text(f"TRACKER = {TRACKER!r}\n" + STAGE)
    flag = tmp_path / "sampled"
    monkeypatch.setattr(runner, "stage_command",
                        lambda run, d, resume: [sys.executable, str(script), f"run.dir={d}", str(flag)])
    real_tree = runner._tree

    def tree_then_flag(root: int) -> list[psutil.Process]:
        procs = real_tree(root)
        if len(procs) >= 3:  # the stage and both its children: the runner has seen them
            flag.touch()
        return procs

    monkeypatch.setattr(runner, "_tree", tree_then_flag)
    monkeypatch.setattr(runner, "LOAD_SAMPLE_S", 0.1)
    monkeypatch.setattr(runner, "LEFTOVER_GRACE_S", 4.0)
    lines = []
    result = runner.execute(Run("sao", 1, "examples/tiny_cpu.yaml"), tmp_path / "work", log=lines.append)
    assert not result.ok
    engine = psutil.Process(int((result.dir / "engine.pid").read_text()))  # reaped by init only once killed
    deadline = time.monotonic() + 10
    while engine.is_running() and engine.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE
    (left,) = [line for line in lines if "left running" in line]
    assert f"pid {engine.pid}" in left and f"pid {(result.dir / 'tracker.pid').read_text()}" not in left, left
