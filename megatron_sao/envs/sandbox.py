"""A sandbox for model-written Python: one fresh, isolated, bounded process tree per call.

``await run_python(code, limits)`` runs ``code`` as ``main.py`` through ``sandbox_bootstrap.py``,
which sets up isolation before the untrusted code starts. Two modes, chosen per host:

**namespaces** (root; or any user where unprivileged user namespaces work, the usual cluster case):
a new user (non-root), mount, PID, network, IPC, UTS and cgroup namespace per call. The call sees
its own root filesystem (sandbox_child/rootfs.py): the system directories and the interpreter's
standard library read-only, a private tmpfs of ``max_disk_mb`` for /tmp and its working directory,
and a /proc of its own processes only -- no home directories, datasets, answers, run directory, or
other processes (the trainer's environment included). It has no network interface. Its first process
is PID 1 of the namespace: when the program ends, everything it started is killed by the kernel,
however it daemonized. As root the code runs under a private uid from ``[uid_base, uid_base + 1024)``
and the whole tree is in a cgroup (memory and process count of the call as a whole, OOM reported);
as non-root it has no capabilities and RLIMIT_NPROC counts only its own user namespace.

**process** (no namespaces: root in a container without CAP_SYS_ADMIN, or a non-root user without
user namespaces): the call's own process group under a child subreaper, a private uid as root,
seccomp (no signals outside the group, no leaving it, no IPv4/IPv6 sockets, no ptrace), rlimits and
audit hooks (no reads or writes outside the working directory and the standard library, no
spawning, no ctypes). Running untrusted code as the trainer's *own* uid this way is refused unless
``SandboxPool(allow_same_uid=True)`` (config: ``env.sandbox_allow_same_uid``): the trainer then
makes itself non-dumpable so the code cannot read its /proc entries (environment, memory).

Both modes: rlimits per process (CPU time, address space, file size, open files), a seccomp filter
(sandbox_child/syscall_filter.py), stdin /dev/null, an environment of PATH, LANG, HOME only, the wall
clock and an output cap enforced here. A call returns when its program ends; processes it left
behind are killed and counted (``leftover_processes``), not charged the full wall clock.
``SandboxResult.isolation`` lists the layers that were active for the call.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import sysconfig
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from megatron_sao.envs.sandbox_cgroup import CallCgroup, CgroupFactory

_BOOTSTRAP_SOURCE = Path(__file__).with_name("sandbox_bootstrap.py").read_text(encoding="utf-8")
_CHILD_PATH = str(Path(__file__).with_name("sandbox_child"))
_KILL_BIN = shutil.which("kill")
_READ_CHUNK = 4096
_EXIT_GRACE_S = 2.0  # after the program's end, how long output pipes may stay open


class SandboxError(RuntimeError):
    """The sandbox itself failed (a host problem, not something the policy did)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandbox call. ``memory_mb`` and ``max_processes`` bound each process
    and, where a cgroup is available (root), the call's whole process tree; ``max_disk_mb`` bounds
    everything the call writes (its private tmpfs) in namespaces mode."""

    wall_time_s: float = 10.0
    cpu_time_s: int = 10
    memory_mb: int = 1024
    max_processes: int = 16
    max_output_bytes: int = 16_384
    max_file_mb: int = 16
    max_disk_mb: int = 64
    max_open_files: int = 64
    allow_site_packages: bool = False  # False: stdlib only (python -S)

    def __post_init__(self) -> None:
        for name in ("wall_time_s", "cpu_time_s", "memory_mb", "max_processes",
                     "max_output_bytes", "max_file_mb", "max_disk_mb", "max_open_files"):
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
    leftover_processes: int = 0  # still running when the program ended; killed then

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
        if self.leftover_processes:
            parts.append(f"[{self.leftover_processes} background process(es) still running when the program "
                         "ended were killed]")
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

    Round-robin rather than lowest-free: a uid is reused only after all the others have been used
    once, so nothing of an earlier call (a zombie counted against RLIMIT_NPROC) can meet a new one.
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
_NAMESPACES_WORK: dict[bool, bool] = {}  # userns? -> whether namespaced calls work on this host
_CGROUPS: dict[str, CgroupFactory | None] = {}


def _readonly_paths(allow_site_packages: bool) -> list[str]:
    """What the call may read besides the system directories: the interpreter's install tree
    (standard library, lib-dynload, libpython), and the environment's site-packages only when asked."""
    paths = {os.path.realpath(sys.base_prefix), os.path.dirname(os.path.realpath(os.__file__))}
    if allow_site_packages:
        for key in ("purelib", "platlib"):
            paths.add(os.path.realpath(sysconfig.get_paths()[key]))
    return sorted(p for p in paths if p != "/")


def _check_readable_by_others(path: str) -> None:
    """Process mode as root runs the code under a private uid, in the host's filesystem: it must be
    able to read the standard library (a Python under root's 0700 home cannot)."""
    parts = path.rstrip("/").split("/")
    for i in range(2, len(parts) + 1):
        d = "/".join(parts[:i])
        if not os.stat(d).st_mode & 0o001:
            raise SandboxError(f"sandbox: process mode runs model code under a private uid, which cannot reach the "
                               f"standard library at {path} ({d} is not searchable by other users); install "
                               "Python where other users can read it, or allow namespaces (CAP_SYS_ADMIN)")


def _make_undumpable() -> None:
    """The trainer itself: /proc/<trainer>/{environ,mem,fd} become unreadable to same-uid processes."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise SandboxError(f"prctl(PR_SET_DUMPABLE, 0) failed: errno {ctypes.get_errno()}")


class SandboxPool:
    """Runs sandbox calls with at most ``max_concurrency`` in flight per event loop.

    ``isolation``: "auto" (namespaces where the host allows them, else process mode), or
    "namespaces" / "process" to insist on one. ``allow_same_uid``: let process mode run the code as
    the trainer's own uid (non-root without user namespaces); refused otherwise."""

    def __init__(self, max_concurrency: int = 8, uid_base: int = 200_000, allow_same_uid: bool = False,
                 isolation: str = "auto", cgroups: bool = True) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if not 1000 <= uid_base <= 2**31 - _UidSlots.SIZE:
            raise ValueError(f"uid_base must be an unprivileged uid range start, got {uid_base}")
        if isolation not in ("auto", "namespaces", "process"):
            raise ValueError(f"isolation must be auto, namespaces or process, got {isolation!r}")
        self.max_concurrency, self.uid_base = max_concurrency, uid_base
        self.allow_same_uid, self.isolation, self.cgroups = allow_same_uid, isolation, cgroups
        self.privileged = os.geteuid() == 0
        # asyncio primitives bind to one loop; keep one semaphore per loop.
        self._sems: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        sem = self._sems.get(loop)
        if sem is None:
            sem = self._sems[loop] = asyncio.Semaphore(self.max_concurrency)
        return sem

    def _cgroup_factory(self) -> CgroupFactory | None:
        if not (self.cgroups and self.privileged):
            return None
        if "auto" not in _CGROUPS:
            _CGROUPS["auto"] = CgroupFactory.detect()
        return _CGROUPS["auto"]

    async def _mode(self) -> str:
        """namespaces or process, for this host; the first call probes namespaces once per process."""
        if self.isolation != "process":
            userns = not self.privileged
            if userns not in _NAMESPACES_WORK:
                try:
                    probe = await self._call("pass", SandboxLimits(wall_time_s=30), "namespaces")
                    _NAMESPACES_WORK[userns] = probe.exit_code == 0 and "pidns" in probe.isolation
                except SandboxError:
                    _NAMESPACES_WORK[userns] = False
            if _NAMESPACES_WORK[userns]:
                return "namespaces"
            if self.isolation == "namespaces":
                raise SandboxError("sandbox: namespaces are not available on this host "
                                   f"({'mount/PID/network namespaces' if self.privileged else 'user namespaces'})")
        if not self.privileged and not self.allow_same_uid:
            raise SandboxError(
                "sandbox: user namespaces are not available here (sysctl user.max_user_namespaces, "
                "kernel.unprivileged_userns_clone or an AppArmor/SELinux policy), so model code would run as "
                "the trainer's own uid with seccomp, rlimits and audit hooks only; set "
                "env.sandbox_allow_same_uid: true (SandboxPool(allow_same_uid=True)) to accept that")
        if not self.privileged:
            _make_undumpable()
        else:
            _check_readable_by_others(os.path.dirname(os.path.realpath(os.__file__)))
        return "process"

    async def run(self, code: str, limits: SandboxLimits | None = None) -> SandboxResult:
        if not isinstance(code, str):
            raise TypeError(f"code must be str, got {type(code).__name__}")
        limits = limits or SandboxLimits()
        async with self._semaphore():
            return await self._call(code, limits, await self._mode())

    async def _call(self, code: str, limits: SandboxLimits, mode: str) -> SandboxResult:
        uid = _UIDS.acquire(self.uid_base) if self.privileged else None
        workdir = Path(tempfile.mkdtemp(prefix="sao-sandbox-"))
        cg = None
        try:
            factory = self._cgroup_factory()
            if factory is not None:
                cg = factory.create(limits.memory_mb << 20, limits.max_processes + 2)  # + bootstrap A, B
            return await self._run_in(workdir, uid, code, limits, mode, cg, factory)
        finally:
            if cg is not None:
                cg.close()
            if uid is not None and mode == "process":
                await _kill_all_of_uid(uid)
            shutil.rmtree(workdir, ignore_errors=True)
            if uid is not None:
                _UIDS.release(uid)

    async def _run_in(self, workdir: Path, uid: int | None, code: str, limits: SandboxLimits, mode: str,
                      cg: CallCgroup | None, factory: CgroupFactory | None) -> SandboxResult:
        code_file = workdir / "main.py"
        code_file.write_text(code, encoding="utf-8")
        if uid is not None and mode == "process":
            os.chown(workdir, uid, uid)
            os.chown(code_file, uid, uid)
        isolation = _planned_isolation(mode, uid, limits, cg, factory)
        readonly = _readonly_paths(limits.allow_site_packages)
        status_r, status_w = os.pipe()
        cfg = {
            "mode": mode, "userns": mode == "namespaces" and uid is None, "uid": uid,
            "workdir": str(workdir), "code_file": str(code_file), "status_fd": status_w,
            "child_path": _CHILD_PATH, "readonly": readonly, "read_roots": readonly,
            "cgroup_procs": cg.procs_files if cg is not None else [], "isolation": isolation,
            "interpreter": os.path.realpath(sys.executable),
            "limits": {"cpu_s": limits.cpu_time_s, "memory_mb": limits.memory_mb, "fsize_mb": limits.max_file_mb,
                       "disk_mb": limits.max_disk_mb, "nofile": limits.max_open_files,
                       "nproc": limits.max_processes},
        }
        flags = ["-I", "-B"] + ([] if limits.allow_site_packages else ["-S"])
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(workdir)}
        t0 = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, *flags, "-c", _BOOTSTRAP_SOURCE, json.dumps(cfg),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, cwd=str(workdir), env=env,
                close_fds=True, pass_fds=(status_w,), start_new_session=True)
        finally:
            os.close(status_w)
        status = _StatusReader(status_r)
        return await _collect(proc, status, limits, t0, cg)


def _planned_isolation(mode: str, uid: int | None, limits: SandboxLimits, cg: CallCgroup | None,
                       factory: CgroupFactory | None) -> list[str]:
    """The layers the parent sets up or asks for; the child appends what it installed itself."""
    out = [f"uid={uid}" if uid is not None else ("userns" if mode == "namespaces" else "uid=same")]
    if mode == "namespaces":
        out += ["pidns", "netns", "mountns", "ipcns", "utsns", "rootfs=private", f"disk=tmpfs:{limits.max_disk_mb}m"]
    else:
        out += ["pgroup", "subreaper", f"disk=per-file:{limits.max_file_mb}m"]
        if uid is None:
            out.append("parent=nondumpable")
    if cg is not None:
        out += [f"memory={factory.kind}:{limits.memory_mb}m", f"pids={factory.kind}:{limits.max_processes}"]
    else:
        out.append(f"memory=per-process:{limits.memory_mb}m")
    nproc_scope = "uid" if uid is not None else ("userns" if mode == "namespaces" else "uid+running")
    out.append(f"nproc={nproc_scope}:{limits.max_processes}")
    return out


class _StatusReader:
    """Reads the bootstrap's status pipe (JSON lines) until every writer has closed it."""

    def __init__(self, fd: int) -> None:
        self.fd, self.msgs = fd, []
        self.done = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                    os.fdopen(self.fd, "rb", buffering=0))
        try:
            while line := await reader.readline():
                try:
                    self.msgs.append(json.loads(line))
                except ValueError:
                    pass
        finally:
            transport.close()

    def get(self, key: str):
        return next((m[key] for m in self.msgs if key in m), None)

    def final(self) -> dict:
        return next((m for m in self.msgs if "leftovers" in m), {})


async def _collect(proc: asyncio.subprocess.Process, status: _StatusReader, limits: SandboxLimits, t0: float,
                   cg: CallCgroup | None) -> SandboxResult:
    """Read both streams under the output cap and the wall clock until the program ends (the
    status pipe closes when the bootstrap is done); kill the call's processes on either limit."""
    cap = limits.max_output_bytes
    over = asyncio.Event()
    bufs = {"out": bytearray(), "err": bytearray()}
    truncated = {"out": False, "err": False}

    async def pump(stream: asyncio.StreamReader, key: str) -> None:
        buf = bufs[key]
        while chunk := await stream.read(_READ_CHUNK):
            room = cap - len(buf)
            buf += chunk[:max(room, 0)]
            if len(chunk) > room:
                truncated[key] = True
                over.set()
        # Past the cap the pump keeps reading (and discarding) until EOF: a pipe nobody reads
        # pauses its transport, and the process's exit would never be seen.

    pumps = asyncio.ensure_future(asyncio.gather(pump(proc.stdout, "out"), pump(proc.stderr, "err")))
    overflow = asyncio.ensure_future(over.wait())
    done, _ = await asyncio.wait({status.done, overflow}, timeout=limits.wall_time_s,
                                 return_when=asyncio.FIRST_COMPLETED)
    reason = None
    if status.done not in done:
        reason = "output_limit" if overflow in done else "wall_timeout"
    else:  # the program ended: its output is complete once the pipes close
        await asyncio.wait({pumps}, timeout=_EXIT_GRACE_S)
    if reason is not None or not pumps.done():
        _kill_call(proc.pid, status.get("child"), cg)
    await proc.wait()
    await asyncio.wait({pumps, status.done}, timeout=_EXIT_GRACE_S)
    for f in (pumps, status.done, overflow):
        f.cancel()
    await asyncio.gather(pumps, status.done, overflow, return_exceptions=True)
    wall = time.monotonic() - t0

    err = bytes(bufs["err"]).decode("utf-8", errors="replace")
    ready, final = status.get("ready"), status.final()
    if ready is None and reason is None:
        why = status.get("error") or f"bootstrap exit {proc.returncode}: {err[-2000:]}"
        raise SandboxError(f"sandbox failed to start: {why}")
    rc = final.get("exit")
    if final.get("signal"):
        rc = -final["signal"]
    if reason == "wall_timeout":
        reason = f"wall-clock limit of {limits.wall_time_s:g} s exceeded"
    elif reason == "output_limit":
        reason = f"output limit of {cap} bytes exceeded"
    elif cg is not None and cg.oom_killed():
        reason = f"memory limit of {limits.memory_mb} MiB for the whole call exceeded (OOM kill)"
    elif rc == -signal.SIGXCPU:
        reason = f"CPU time limit of {limits.cpu_time_s} s exceeded"
    elif rc is not None and rc < 0:
        reason = f"terminated by signal {signal.Signals(-rc).name}"
    elif not final:
        reason = "the sandbox's process ended without reporting (killed from outside?)"
    return SandboxResult(
        stdout=bytes(bufs["out"]).decode("utf-8", errors="replace"), stderr=err, exit_code=rc,
        timed_out=reason is not None and reason.startswith("wall-clock"), killed_reason=reason,
        stdout_truncated=truncated["out"], stderr_truncated=truncated["err"], wall_time_s=wall,
        isolation=tuple(ready or ()), leftover_processes=int(final.get("leftovers") or 0))


def _kill_call(pid: int, child: int | None, cg: CallCgroup | None) -> None:
    """Kill the bootstrap's group (A and the PID namespace's init B: the kernel then kills the rest of
    the namespace), the user process's own group (process mode), and the cgroup."""
    for group in (pid, child):
        if group:
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    if cg is not None:
        cg.kill_all()


async def _kill_all_of_uid(uid: int) -> None:
    """Kill every process of a private sandbox uid (process mode: catches anything left anywhere)."""
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
_DEFAULT_OPTIONS: dict = {}


def configure_default_pool(allow_same_uid: bool = False) -> None:
    """Settings of the pool `run_python` uses (the trainer calls this from the config's env section)."""
    _DEFAULT_OPTIONS["allow_same_uid"] = allow_same_uid
    _DEFAULT_POOLS.clear()


def default_pool() -> SandboxPool:
    """The process-wide pool used by ``run_python`` (concurrency from $SAO_SANDBOX_CONCURRENCY)."""
    pool = _DEFAULT_POOLS.get(0)
    if pool is None:
        n = int(os.environ.get("SAO_SANDBOX_CONCURRENCY", "8"))
        pool = _DEFAULT_POOLS[0] = SandboxPool(max_concurrency=n, **_DEFAULT_OPTIONS)
    return pool


async def run_python(code: str, limits: SandboxLimits | None = None,
                     pool: SandboxPool | None = None) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed Python process and return what it did."""
    return await (pool or default_pool()).run(code, limits)
