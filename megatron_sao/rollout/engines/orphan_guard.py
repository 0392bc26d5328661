"""A guard process that kills an in-process vLLM's EngineCore when the trainer dies without closing it.

AsyncLLM runs its EngineCore in a child process that never checks on its parent (vLLM's workers watch
their EngineCore through a death pipe; the EngineCore watches nobody). A trainer that ends by SIGKILL
(the kernel's OOM killer, `kill -9`) so leaves the EngineCore and its worker running: 3.3 GB on
SmolLM2, measured, and the next run on the machine was OOM-killed in turn. A scheduler's cgroup reaps
them at the job's end; a workstation keeps them until someone kills them. So the trainer hands each
EngineCore to this guard (`watch`), which kills it and its descendants once the trainer is gone.

The guard is a fresh interpreter running this file (`python -P orphan_guard.py <trainer pid>`: the
trainer's sys.path less this folder, whose module names could shadow others), not a fork: a fork of
the trainer would keep a copy-on-write image of it for as long as it lives (the writers' server's
lesson, megatron/writer_results.py). It reads "pid create_time" lines on stdin and polls its parent:
once reparented, the trainer is gone, and it SIGKILLs each registered process that is still the one
registered (same creation time: the pid may have been reused after a clean close) and the descendants
it has at that moment. It polls rather than use PR_SET_PDEATHSIG because that signal follows the thread
that started the guard, and an engine may be built from a thread that ends long before the trainer.
It ignores SIGINT and SIGTERM: a Ctrl-C or a scancel reaches the whole process group, and the trainer's
own handlers close its engines (the guard must outlive them to cover a SIGKILL after).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil

POLL_S = 0.5

_lock = threading.Lock()
_guard: subprocess.Popen | None = None
_guard_owner = 0  # the pid that started _guard (a forked child starts its own)


def watch(pids: list[int]) -> None:
    """Kill these processes (and their descendants) if this process dies before they do."""
    global _guard, _guard_owner
    lines = []
    for pid in pids:
        try:
            lines.append(f"{pid} {psutil.Process(pid).create_time()!r}\n")
        except psutil.NoSuchProcess:
            continue  # already gone: nothing to guard
    if not lines:
        return
    with _lock:
        if _guard is None or _guard_owner != os.getpid() or _guard.poll() is not None:
            _guard = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__), str(os.getpid())],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, close_fds=True)
            _guard_owner = os.getpid()
            if _guard.stdout.readline() != "guarding\n":  # its signal dispositions are set from here on
                raise RuntimeError(f"orphan_guard: the guard process exited at start-up ({_guard.wait()})")
        _guard.stdin.write("".join(lines))
        _guard.stdin.flush()


def kill_registered(registered: dict[int, float]) -> list[int]:
    """SIGKILL each registered process that is still the one registered, and its descendants; the pids killed."""
    killed = []
    for pid, created in registered.items():
        try:
            root = psutil.Process(pid)
            if root.create_time() != created:
                continue  # the pid was reused: not ours
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in tree:
            try:
                p.kill()
                killed.append(p.pid)
            except psutil.NoSuchProcess:
                pass
    return killed


def _serve(parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    registered: dict[int, float] = {}

    def read() -> None:  # a thread: a pipe read blocks, the parent check must not
        for line in sys.stdin:
            pid, created = line.split()
            registered[int(pid)] = float(created)

    threading.Thread(target=read, daemon=True).start()
    print("guarding", flush=True)
    while os.getppid() == parent:
        time.sleep(POLL_S)
    time.sleep(POLL_S)  # the last lines the trainer wrote before it died
    killed = kill_registered(dict(registered))
    if killed:
        print(f"orphan_guard: trainer {parent} is gone; killed its vLLM processes {killed}", file=sys.stderr,
              flush=True)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
