"""Start, watch and stop a set of role processes: the Python twin of slurm/common.sh's node logic.

Same protocol as the SLURM path: every process runs in its own session (so a stop reaches its
whole tree: torchrun's workers, a server's engine processes), writes its own log file, servers
must answer GET /health before the trainer starts (with a deadline, failing early when a server
dies while we wait), a rollout server that exits is restarted under a ``RestartPolicy`` (bounded
attempts, doubling delays, each logged), the trainer's exit decides the outcome, and every other
process gets SIGTERM, a grace period, then SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Mapping, Sequence


class SupervisorError(RuntimeError):
    """A role failed to start, stayed unhealthy past its deadline, or died."""


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen
    log: str
    argv: Sequence[str] = ()
    env: Mapping[str, str] | None = None
    cwd: str | None = None


@dataclass(frozen=True)
class RestartPolicy:
    """How a rollout server that exited is restarted: at most ``max_restarts`` times, restart n after
    ``backoff_s * 2**(n-1)`` seconds (at most ``max_backoff_s``). slurm/common.sh does the same with
    SAO_SERVER_RESTARTS and SAO_RESTART_BACKOFF_S."""

    max_restarts: int = 3
    backoff_s: float = 10.0
    max_backoff_s: float = 300.0

    def delay(self, attempt: int) -> float | None:
        """Seconds before restart ``attempt`` (1-based), or None when no restart is left."""
        if attempt > self.max_restarts:
            return None
        return min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)


def http_ok(url: str, timeout_s: float = 5.0) -> bool:
    """True when GET `url` answers 2xx within `timeout_s`."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


class Supervisor:
    """Owns the processes it starts; use as a context manager so they never outlive it."""

    def __init__(self, grace_s: float = 30.0, poll_s: float = 0.5) -> None:
        self.grace_s = grace_s
        self.poll_s = poll_s
        self.procs: list[_Proc] = []

    def start(self, name: str, argv: Sequence[str], log: str, env: Mapping[str, str] | None = None,
              cwd: str | None = None) -> None:
        """Start `argv` in a new session, stdout+stderr appended to `log`."""
        os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
        full_env = {**os.environ, **(env or {})}
        with open(log, "ab") as fh:
            popen = subprocess.Popen(list(argv), stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=full_env, cwd=cwd, start_new_session=True)
        self.procs.append(_Proc(name, popen, log, list(argv), env, cwd))

    def restart(self, name: str) -> None:
        """Start the exited process ``name`` again (same argv, environment and log); what is left of its
        process group (engine workers) is killed first."""
        (p,) = [p for p in self.procs if p.name == name]
        if p.popen.poll() is None:
            raise SupervisorError(f"restart of {name}: it is still running")
        self._signal(p, signal.SIGKILL)
        self.procs.remove(p)
        self.start(name, p.argv, p.log, p.env, p.cwd)

    def forget(self, name: str) -> None:
        """Stop watching the exited process ``name`` (no restart left): ``wait_any`` skips it."""
        for p in [p for p in self.procs if p.name == name]:
            self._signal(p, signal.SIGKILL)
            self.procs.remove(p)

    def _dead(self) -> list[_Proc]:
        return [p for p in self.procs if p.popen.poll() is not None]

    def wait_healthy(self, urls: Sequence[str], timeout_s: float) -> None:
        """Block until every URL answers 2xx; raise naming the laggards or the process that died."""
        pending = list(urls)
        deadline = time.monotonic() + timeout_s
        while pending:
            pending = [u for u in pending if not http_ok(u, timeout_s=min(5.0, timeout_s))]
            if not pending:
                break
            dead = self._dead()
            if dead:
                d = dead[0]
                raise SupervisorError(f"{d.name} exited with code {d.popen.returncode} before it became healthy "
                                      f"(log: {d.log})")
            if time.monotonic() > deadline:
                raise SupervisorError(f"no /health answer after {timeout_s:g}s from: {', '.join(pending)}")
            time.sleep(self.poll_s)

    def wait_any(self, timeout_s: float | None = None) -> tuple[str, int]:
        """Wait until some process exits; return (name, exit code). Raises on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            dead = self._dead()
            if dead:
                return dead[0].name, int(dead[0].popen.returncode)
            if deadline is not None and time.monotonic() > deadline:
                raise SupervisorError(f"no process exited within {timeout_s:g}s")
            time.sleep(self.poll_s)

    def stop_all(self) -> None:
        """SIGTERM every process group, wait up to grace_s, then SIGKILL what is left."""
        for p in self.procs:
            self._signal(p, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for p in self.procs:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                p.popen.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                pass
            # The leader may be gone while its children linger: kill the group regardless.
            self._signal(p, signal.SIGKILL)
            try:
                p.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    @staticmethod
    def _signal(p: _Proc, sig: int) -> None:
        try:
            os.killpg(p.popen.pid, sig)  # pgid == pid: start_new_session made it a group leader
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
