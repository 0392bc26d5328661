"""A sandbox for model-written Python: one fresh, limited, isolated subprocess per call.

``await run_python(code, limits)`` writes ``code`` to ``main.py`` in a new private temporary
directory and runs it with ``python -I -B [-S]`` through ``sandbox_bootstrap.py`` (which sets up
isolation before the untrusted code starts). What bounds a call:

=====================  ===========================================================================
wall clock             asyncio timeout, then SIGKILL to the whole process session
CPU time               RLIMIT_CPU (SIGXCPU at the limit, SIGKILL one second later)
memory                 RLIMIT_AS (allocation fails with MemoryError)
processes              RLIMIT_NPROC; as root the child runs under an unprivileged uid so it applies
output                 at most ``max_output_bytes`` per stream are kept; exceeding it kills the run
file writes            RLIMIT_FSIZE; writes outside the working directory are denied
network                new network namespace (root) and an audit hook on IPv4/IPv6 sockets
environment            only PATH, LANG, HOME=workdir; stdin is /dev/null; fds are closed
=====================  ===========================================================================

Running as root (our trainer nodes and this machine) each concurrent call gets its *own* uid
from ``[uid_base, uid_base + 1024)``. A shared uid such as ``nobody`` would share one
RLIMIT_NPROC count across all sandboxes (one fork bomb would starve every concurrent call and
every other ``nobody`` process on the host); a private uid also lets us kill every process the
call left behind, even ones that escaped its session, with one ``kill -9 -1`` run as that uid.
As non-root there are no namespaces and no uid change: the audit hooks are then the barrier for
network and file writes, so spawning programs and ctypes are denied as well (they bypass hooks).
``SandboxResult.isolation`` says which layers were active for a call.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from megatron_sao.envs.sandbox_bootstrap import STATUS_PREFIX

_BOOTSTRAP_SOURCE = Path(__file__).with_name("sandbox_bootstrap.py").read_text(encoding="utf-8")
_MASK_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_KILL_BIN = shutil.which("kill")
_READ_CHUNK = 4096


class SandboxError(RuntimeError):
    """The sandbox itself failed (a host problem, not something the policy did)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandbox call."""

    wall_time_s: float = 10.0
    cpu_time_s: int = 10
    memory_mb: int = 1024
    max_processes: int = 16
    max_output_bytes: int = 16_384
    max_file_mb: int = 16
    max_open_files: int = 64
    allow_site_packages: bool = False  # False: stdlib only (python -S)

    def __post_init__(self) -> None:
        for name in ("wall_time_s", "cpu_time_s", "memory_mb", "max_processes",
                     "max_output_bytes", "max_file_mb", "max_open_files"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {v!r}")
        if not isinstance(self.cpu_time_s, int):
            raise ValueError(f"SandboxLimits.cpu_time_s must be an int (seconds), got {self.cpu_time_s!r}")


@dataclass
class SandboxResult:
    """What one call produced. ``exit_code`` is negative for a signal, None if never started."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool = False
    killed_reason: str | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_time_s: float = 0.0
    isolation: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_reason is None

    def as_observation(self, max_chars: int = 4000) -> str:
        """Text shown to the policy: output, then bracketed notes on errors and limits."""
        parts: list[str] = []
        if self.stdout:
            parts.append(_clip(self.stdout, max_chars))
        if self.stderr:
            parts.append("[stderr]\n" + _clip(self.stderr, max_chars))
        if self.stdout_truncated or self.stderr_truncated:
            parts.append("[output truncated: the output size limit was reached]")
        if self.killed_reason is not None:
            parts.append(f"[killed: {self.killed_reason}]")
        elif self.exit_code not in (0, None):
            parts.append(f"[exit status {self.exit_code}]")
        if not parts:
            parts.append("[no output]")
        return "\n".join(parts)


def _clip(text: str, max_chars: int) -> str:
    text = text.rstrip("\n")
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]}\n...[{len(text) - max_chars} chars omitted]...\n{text[-half:]}"


class _UidSlots:
    """Process-wide allocator of private sandbox uids (thread-safe: pools may live in several loops).

    Round-robin rather than lowest-free: killed sandbox processes linger as zombies until init
    reaps them, and zombies still count against RLIMIT_NPROC of their uid, so a uid is reused
    only after all the others have been used once.
    """

    SIZE = 1024

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._used: set[int] = set()
        self._cursor = 0

    def acquire(self, base: int) -> int:
        with self._lock:
            for k in range(self.SIZE):
                uid = base + (self._cursor + k) % self.SIZE
                if uid not in self._used:
                    self._used.add(uid)
                    self._cursor = (self._cursor + k + 1) % self.SIZE
                    return uid
        raise SandboxError(f"all {self.SIZE} sandbox uids from {base} are in use")

    def release(self, uid: int) -> None:
        with self._lock:
            self._used.discard(uid)


_UIDS = _UidSlots()


class SandboxPool:
    """Runs sandbox calls with at most ``max_concurrency`` in flight per event loop."""

    def __init__(self, max_concurrency: int = 8, uid_base: int = 200_000) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if not 1000 <= uid_base <= 2**31 - _UidSlots.SIZE:
            raise ValueError(f"uid_base must be an unprivileged uid range start, got {uid_base}")
        self.max_concurrency = max_concurrency
        self.uid_base = uid_base
        self.privileged = os.geteuid() == 0
        # asyncio primitives bind to one loop; keep one semaphore per loop.
        self._sems: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        sem = self._sems.get(loop)
        if sem is None:
            sem = self._sems[loop] = asyncio.Semaphore(self.max_concurrency)
        return sem

    async def run(self, code: str, limits: SandboxLimits | None = None) -> SandboxResult:
        if not isinstance(code, str):
            raise TypeError(f"code must be str, got {type(code).__name__}")
        limits = limits or SandboxLimits()
        async with self._semaphore():
            uid = _UIDS.acquire(self.uid_base) if self.privileged else None
            workdir = Path(tempfile.mkdtemp(prefix="sao-sandbox-"))
            try:
                return await self._run_in(workdir, uid, code, limits)
            finally:
                if uid is not None:
                    await _kill_all_of_uid(uid)
                shutil.rmtree(workdir, ignore_errors=True)
                if uid is not None:
                    _UIDS.release(uid)

    async def _run_in(self, workdir: Path, uid: int | None, code: str, limits: SandboxLimits) -> SandboxResult:
        code_file = workdir / "main.py"
        code_file.write_text(code, encoding="utf-8")
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chown(code_file, uid, uid)
        cfg = {
            "workdir": str(workdir), "code_file": str(code_file), "uid": uid, "gid": uid,
            "mask_dirs": list(_MASK_DIRS),
            "limits": {"cpu_s": limits.cpu_time_s, "memory_mb": limits.memory_mb,
                       "fsize_mb": limits.max_file_mb, "nofile": limits.max_open_files,
                       "nproc": limits.max_processes},
        }
        flags = ["-I", "-B"] + ([] if limits.allow_site_packages else ["-S"])
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(workdir)}
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *flags, "-c", _BOOTSTRAP_SOURCE, json.dumps(cfg),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=str(workdir), env=env,
            close_fds=True, start_new_session=True)
        return await _collect(proc, limits, t0)


async def _collect(proc: asyncio.subprocess.Process, limits: SandboxLimits, t0: float) -> SandboxResult:
    """Read both streams under the output cap and the wall clock; kill the session on either."""
    cap = limits.max_output_bytes
    over = asyncio.Event()
    # stderr may start with the bootstrap's status line, which must not count against the cap.
    bufs = {"out": bytearray(), "err": bytearray()}
    truncated = {"out": False, "err": False}

    async def pump(stream: asyncio.StreamReader, key: str, allowance: int) -> None:
        buf = bufs[key]
        while chunk := await stream.read(_READ_CHUNK):
            room = cap + allowance - len(buf)
            buf += chunk[:max(room, 0)]
            if len(chunk) > room:
                truncated[key] = True
                over.set()
        # Past the cap the pump keeps reading (and discarding) until EOF: a pipe nobody reads
        # pauses its transport, its EOF is never seen, and on Python 3.11 Process.wait() only
        # returns once every pipe is closed, so the call would hang after the kill.

    pumps = [asyncio.ensure_future(pump(proc.stdout, "out", 0)),
             asyncio.ensure_future(pump(proc.stderr, "err", 256))]
    finished = asyncio.ensure_future(asyncio.gather(*pumps, proc.wait()))
    overflow = asyncio.ensure_future(over.wait())
    done, _ = await asyncio.wait({finished, overflow}, timeout=limits.wall_time_s,
                                 return_when=asyncio.FIRST_COMPLETED)
    reason = None
    if finished not in done:
        reason = "output_limit" if overflow in done else "wall_timeout"
        _kill_session(proc.pid)
        await proc.wait()
        for p in pumps:
            p.cancel()
        await asyncio.gather(finished, return_exceptions=True)
    overflow.cancel()
    wall = time.monotonic() - t0

    err = bytes(bufs["err"]).decode("utf-8", errors="replace")
    isolation: tuple[str, ...] = ()
    if err.startswith(STATUS_PREFIX):
        status, _, err = err.partition("\n")
        isolation = tuple(status[len(STATUS_PREFIX):].strip().split(","))
    elif reason is None:
        raise SandboxError(f"sandbox failed to start (exit {proc.returncode}): {err[-2000:]}")
    rc = proc.returncode
    if reason == "wall_timeout":
        reason = f"wall-clock limit of {limits.wall_time_s:g} s exceeded"
    elif reason == "output_limit":
        reason = f"output limit of {cap} bytes exceeded"
    elif rc == -signal.SIGXCPU:
        reason = f"CPU time limit of {limits.cpu_time_s} s exceeded"
    elif rc is not None and rc < 0:
        reason = f"terminated by signal {signal.Signals(-rc).name}"
    return SandboxResult(
        stdout=bytes(bufs["out"]).decode("utf-8", errors="replace"), stderr=err, exit_code=rc,
        timed_out=reason is not None and reason.startswith("wall-clock"), killed_reason=reason,
        stdout_truncated=truncated["out"], stderr_truncated=truncated["err"],
        wall_time_s=wall, isolation=isolation)


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # start_new_session=True: pgid == pid
    except ProcessLookupError:
        pass


async def _kill_all_of_uid(uid: int) -> None:
    """Kill every process of a private sandbox uid (catches daemons that left the session)."""
    if _KILL_BIN is not None:
        argv = [_KILL_BIN, "-9", "-1"]
    else:
        argv = [sys.executable, "-I", "-S", "-c", "import os; os.kill(-1, 9)"]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL, user=uid, group=uid, extra_groups=[], env={},
        close_fds=True)
    await proc.wait()  # exit status 1 just means there was nothing left to kill


_DEFAULT_POOLS: dict[int, SandboxPool] = {}


def default_pool() -> SandboxPool:
    """The process-wide pool used by ``run_python`` (concurrency from $SAO_SANDBOX_CONCURRENCY)."""
    pool = _DEFAULT_POOLS.get(0)
    if pool is None:
        n = int(os.environ.get("SAO_SANDBOX_CONCURRENCY", "8"))
        pool = _DEFAULT_POOLS[0] = SandboxPool(max_concurrency=n)
    return pool


async def run_python(code: str, limits: SandboxLimits | None = None,
                     pool: SandboxPool | None = None) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed Python process and return what it did."""
    return await (pool or default_pool()).run(code, limits)
