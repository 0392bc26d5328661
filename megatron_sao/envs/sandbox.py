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
however it daemonized. The code leads a session of its own, and may open sockets of the families its
network namespace governs only (no AF_VSOCK). As root the code runs under a private uid from
``[uid_base, uid_base + 1024)`` and the whole tree is in a cgroup (memory and process count of the
call as a whole, OOM reported); as non-root it has no capabilities and RLIMIT_NPROC counts only its
own user namespace.

**process** (no namespaces: root in a container without CAP_SYS_ADMIN, or a non-root user without
user namespaces): the call's own process group under a child subreaper, a private uid as root, and
what the kernel enforces without namespaces: Landlock (files below the standard library and the
working directory only, no file removal there; TCP, signals and abstract sockets scoped on newer
kernels) and the process-mode seccomp filter (sandbox_child/syscall_filter.py: no signal outside
the group and no leaving it, no socket() of any family -- so no unix-socket connect to a same-uid
tmux/screen/D-Bus/systemd server --, no prlimit, renice, affinity, ioprio or page migration of
another process, no execve after the interpreter started, no SysV IPC, no ptrace, no chmod, chown
or timestamps by path). The call can fork (up to its process budget) but not start another program.
Disk: the parent watches the working directory by directory descriptors and kills the call past
``max_disk_mb`` / ``max_files``, or when it cannot read a directory there (sandbox_call.py; the bound
is that plus one watch period's writes), each file bounded by RLIMIT_FSIZE. Running
untrusted code as the trainer's *own* uid this way is refused unless
``SandboxPool(allow_same_uid=True)`` (config: ``env.sandbox_allow_same_uid``) and needs Landlock;
the trainer then makes itself non-dumpable so the code cannot read its /proc entries.

Both modes: rlimits per process (CPU time, address space, file size, open files), a seccomp filter,
stdin /dev/null, an environment of PATH, LANG, HOME only, the wall clock and an output cap enforced
here. A call returns when its program ends; processes it left behind are killed and counted
(``leftover_processes``), not charged the full wall clock. ``SandboxResult.isolation`` lists the
layers that were active for the call, each enforced by the kernel or by this parent; the audit hook
in the child only makes refusals readable (one line of Python clears it) and is not listed.
Clean-up (killing what is left, removing the working directory and cgroup) runs off the event loop
and finishes even when the call is cancelled.
"""

from __future__ import annotations

import asyncio
import marshal
import os
import sys
import sysconfig
import tempfile
import threading
import time
import weakref
from pathlib import Path

from megatron_sao.envs.sandbox_call import StatusReader, collect, kill_all_of_uid, planned_isolation, remove_tree
from megatron_sao.envs.sandbox_cgroup import CallCgroup, CgroupFactory
from megatron_sao.envs.sandbox_types import SandboxError, SandboxLimits, SandboxResult
from megatron_sao.envs.sandbox_workspace import SandboxWorkspace

__all__ = ["SandboxError", "SandboxLimits", "SandboxPool", "SandboxResult", "SandboxWorkspace",
           "configure_default_pool", "default_pool", "run_python"]

_CHILD_PATH = str(Path(__file__).with_name("sandbox_child"))
# The child imports the bootstrap and its helpers as top-level modules from these directories. They
# are imported here once as well, which writes their bytecode caches (when the package directory is
# writable): the child runs with -B and would otherwise compile them on every call.
_BOOTSTRAP_STUB = (f"import sys; sys.path[:0] = [{str(Path(__file__).parent)!r}, {_CHILD_PATH!r}]; "
                   "import sandbox_bootstrap; sandbox_bootstrap.main()")
from megatron_sao.envs import sandbox_bootstrap  # noqa: E402,F401
from megatron_sao.envs.sandbox_child import landlock, process, rootfs, syscall_filter  # noqa: E402,F401


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


def _readonly_paths(allow_site_packages: bool, extra: tuple[str, ...] = ()) -> list[str]:
    """What the call may read besides the system directories: the interpreter's install tree
    (standard library, lib-dynload, libpython), the environment's site-packages only when asked, and
    the pool's ``readonly_paths`` (a repository's own Python environment for its tests)."""
    paths = {os.path.realpath(sys.base_prefix), os.path.dirname(os.path.realpath(os.__file__))}
    paths.update(os.path.realpath(p) for p in extra)
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
    the trainer's own uid (non-root without user namespaces); refused otherwise. ``readonly_paths``:
    host directories every call may also read, e.g. the Python environment a repository's tests need."""

    def __init__(self, max_concurrency: int = 8, uid_base: int = 200_000, allow_same_uid: bool = False,
                 isolation: str = "auto", cgroups: bool = True, readonly_paths: tuple[str, ...] = ()) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if not 1000 <= uid_base <= 2**31 - _UidSlots.SIZE:
            raise ValueError(f"uid_base must be an unprivileged uid range start, got {uid_base}")
        if isolation not in ("auto", "namespaces", "process"):
            raise ValueError(f"isolation must be auto, namespaces or process, got {isolation!r}")
        self.max_concurrency, self.uid_base = max_concurrency, uid_base
        self.allow_same_uid, self.isolation, self.cgroups = allow_same_uid, isolation, cgroups
        self.readonly_paths = tuple(readonly_paths)  # more directories every call may read (and execute)
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
            if landlock.abi() < 1:
                raise SandboxError(
                    "sandbox: process mode as the trainer's own uid needs Landlock (Linux 5.13+, 'landlock' in the "
                    "kernel's lsm= list) to keep model code away from the user's files; this kernel has none")
            _make_undumpable()
        else:
            _check_readable_by_others(os.path.dirname(os.path.realpath(os.__file__)))
        return "process"

    async def run(self, code: str, limits: SandboxLimits | None = None, *,
                  workspace: SandboxWorkspace | None = None) -> SandboxResult:
        """Run ``code`` in a fresh call; with ``workspace`` (``open_workspace``) its working directory is
        that directory, which keeps what the call changed, and the code may start programs."""
        if not isinstance(code, str):
            raise TypeError(f"code must be str, got {type(code).__name__}")
        limits = limits or SandboxLimits()
        if workspace is not None:
            workspace.check_usable(self)
        async with self._semaphore():
            return await self._call(code, limits, await self._mode(), workspace)

    async def open_workspace(self, source: str | os.PathLike | None = None, *,
                             max_bytes: int = 1 << 30, max_files: int = 100_000) -> SandboxWorkspace:
        """A working directory that outlives calls (envs/sandbox_workspace.py), holding a copy of
        ``source`` (regular files, directories and symlinks only; at most ``max_bytes``/``max_files``)."""
        mode = await self._mode()
        uid = _UIDS.acquire(self.uid_base) if self.privileged else None
        try:
            return await SandboxWorkspace.create(self, mode, uid, source, max_bytes, max_files)
        except BaseException:
            if uid is not None:
                _UIDS.release(uid)
            raise

    async def close_workspace(self, workspace: SandboxWorkspace) -> None:
        """``SandboxWorkspace.close``: its uid's processes (process mode), its directory, its uid."""
        try:
            if workspace.uid is not None and workspace.mode == "process":
                await kill_all_of_uid(workspace.uid)
            await remove_tree(workspace.path)
        finally:
            if workspace.uid is not None:
                _UIDS.release(workspace.uid)

    async def _call(self, code: str, limits: SandboxLimits, mode: str,
                    workspace: SandboxWorkspace | None = None) -> SandboxResult:
        own_uid = workspace is None and self.privileged
        uid = _UIDS.acquire(self.uid_base) if own_uid else (workspace.uid if workspace is not None else None)
        # The call's scratch directory: its working directory (no workspace), the new root's mount point
        # (namespaces), or where its code lies (a workspace in process mode).
        workdir = Path(tempfile.mkdtemp(prefix="sao-sandbox-"))
        cg = None
        try:
            factory = self._cgroup_factory()
            if factory is not None:
                cg = factory.create(limits.memory_mb << 20, limits.max_processes + 2)  # + bootstrap A, B
            return await self._run_in(workdir, uid, code, limits, mode, cg, factory, workspace)
        finally:
            # Shielded: a cancelled call (a rollout's own timeout) still cleans up in full.
            await asyncio.shield(asyncio.ensure_future(_clean_up(workdir, uid, mode, cg, release_uid=own_uid)))

    async def _run_in(self, workdir: Path, uid: int | None, code: str, limits: SandboxLimits, mode: str,
                      cg: CallCgroup | None, factory: CgroupFactory | None,
                      workspace: SandboxWorkspace | None = None) -> SandboxResult:
        code_file = workdir / "main.py"
        code_file.write_text(code, encoding="utf-8")
        if uid is not None and mode == "process":
            os.chown(workdir, uid, uid)
            os.chown(code_file, uid, uid)
        isolation = planned_isolation(mode, uid, limits, cg, factory, workspace=workspace is not None)
        readonly = _readonly_paths(limits.allow_site_packages, self.readonly_paths)
        # Process mode with a workspace: the code's own directory is readable, the workspace writable.
        read_roots = readonly + [str(workdir)] if workspace is not None and mode == "process" else readonly
        status_r, status_w = os.pipe()
        cfg = {
            "mode": mode, "userns": mode == "namespaces" and uid is None, "uid": uid,
            "workdir": str(workdir), "code_file": str(code_file), "status_fd": status_w,
            "workspace": str(workspace.path) if workspace is not None else None, "exec": workspace is not None,
            "child_path": _CHILD_PATH, "readonly": readonly, "read_roots": read_roots,
            "cgroup_procs": cg.procs_files if cg is not None else [], "isolation": isolation,
            "interpreter": os.path.realpath(sys.executable),
            "limits": {"cpu_s": limits.cpu_time_s, "memory_mb": limits.memory_mb, "fsize_mb": limits.max_file_mb,
                       "disk_mb": limits.max_disk_mb, "nofile": limits.max_open_files,
                       "files": limits.max_files, "nproc": limits.max_processes},
        }
        flags = ["-I", "-B"] + ([] if limits.allow_site_packages else ["-S"])
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(workdir)}
        t0 = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, *flags, "-c", _BOOTSTRAP_STUB, marshal.dumps(cfg).hex(),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, cwd=str(workdir), env=env,
                close_fds=True, pass_fds=(status_w,), start_new_session=True)
        finally:
            os.close(status_w)
        status = StatusReader(status_r)
        # The disk watch: process mode's working directory, and a workspace in either mode (it is no tmpfs).
        watch = str(workspace.path) if workspace is not None else str(workdir) if mode == "process" else None
        return await collect(proc, status, limits, t0, cg, watch_dir=watch)


async def _clean_up(workdir: Path, uid: int | None, mode: str, cg: CallCgroup | None,
                    release_uid: bool = True) -> None:
    """After a call, off the event loop: the cgroup (kill, rmdir retries), what a private uid left
    anywhere, the working directory (thousands of files at worst). A workspace's uid stays held."""
    try:
        if cg is not None:
            await asyncio.to_thread(cg.close)
        if uid is not None and mode == "process":
            await kill_all_of_uid(uid)
        await remove_tree(workdir)
    finally:
        if uid is not None and release_uid:
            _UIDS.release(uid)


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
