"""The orphan guard kills a SIGKILLed trainer's registered processes (with their children), and only them.

A stand-in trainer (a Python child) starts a stand-in EngineCore (a shell with a child of its own),
registers it with `orphan_guard.watch`, and is SIGKILLed: the EngineCore tree must go. The real
EngineCore's registration is one line in vllm_engine.py; starting vLLM here would cost a minute and
3 GB for the same check.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

from megatron_sao.rollout.engines import orphan_guard

TRAINER = textwrap.dedent("""
    import subprocess, sys, time
    from megatron_sao.rollout.engines import orphan_guard
    engine = subprocess.Popen(["sh", "-c", "sleep 300 & wait"])
    if sys.argv[1] == "watch":
        orphan_guard.watch([engine.pid])
    print(engine.pid, flush=True)
    time.sleep(300)
""")


def _trainer(mode: str) -> tuple[subprocess.Popen, list[psutil.Process]]:
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, mode], stdout=subprocess.PIPE, text=True)
    engine = psutil.Process(int(trainer.stdout.readline()))
    deadline = time.monotonic() + 30
    while not engine.children() and time.monotonic() < deadline:  # the shell starts its sleep
        time.sleep(0.05)
    return trainer, [engine, *engine.children(recursive=True)]


def _dead(p: psutil.Process) -> bool:
    """Ended: gone, or a zombie (an orphan is reaped by PID 1, which in a container may never reap)."""
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _gone(procs: list[psutil.Process], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not all(_dead(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return all(_dead(p) for p in procs)


def test_a_sigkilled_trainers_engine_tree_is_killed_by_the_guard():
    trainer, tree = _trainer("watch")
    assert len(tree) == 2  # the shell and its sleep
    guard = [p for p in psutil.Process(trainer.pid).children() if "orphan_guard" in " ".join(p.cmdline())]
    assert len(guard) == 1
    guard[0].send_signal(signal.SIGTERM)  # a scancel or Ctrl-C reaches the guard too: it must stay
    guard[0].send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert not _dead(guard[0])
    trainer.kill()
    trainer.wait()
    try:
        assert _gone(tree, within_s=10), [p.pid for p in tree if not _dead(p)]
        assert _gone(guard, within_s=5)  # and the guard ends with its work
    finally:
        for p in [*tree, *guard]:
            if not _dead(p):
                p.kill()


def test_without_the_guard_the_engine_outlives_the_trainer():
    """The failure the guard exists for (so the test above can fail)."""
    trainer, tree = _trainer("no-watch")
    trainer.kill()
    trainer.wait()
    try:
        assert not _gone(tree, within_s=2)
    finally:
        for p in tree:
            p.kill()


def test_a_reused_pid_is_not_killed():
    other = subprocess.Popen(["sleep", "60"])
    try:
        created = psutil.Process(other.pid).create_time()
        assert orphan_guard.kill_registered({other.pid: created - 1.0}) == []  # another process had that pid
        assert other.poll() is None
        assert orphan_guard.kill_registered({other.pid: created}) == [other.pid]
        assert other.wait(timeout=5) == -signal.SIGKILL
    finally:
        if other.poll() is None:
            other.kill()


def test_a_forked_child_gets_a_guard_of_its_own(monkeypatch):
    """`watch` in a fork of a process that has a guard starts a new one: the parent's watches the parent."""
    parents_guard = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    monkeypatch.setattr(orphan_guard, "_guard", parents_guard)  # this process's guard, as the child inherits it
    monkeypatch.setattr(orphan_guard, "_guard_owner", os.getpid())
    engine = subprocess.Popen(["sleep", "60"])
    read, write = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:  # the child: register, report the guard's parent, die without cleanup
            try:
                orphan_guard.watch([engine.pid])
                os.write(write, str(psutil.Process(orphan_guard._guard.pid).ppid()).encode())
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert int(os.read(read, 64)) == pid
        assert _gone([psutil.Process(engine.pid)], within_s=10)  # the child exited: its guard killed the engine
    finally:
        os.close(read)
        os.close(write)
        for p in (engine, parents_guard):
            if p.poll() is None:
                p.kill()
            p.wait()
