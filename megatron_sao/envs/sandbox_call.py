"""One sandbox call from the parent's side: what it asks for, how it reads the call, how it kills it.

The bootstrap (sandbox_bootstrap.py) reports on a status pipe; the call is over when every writer
of that pipe is gone (the bootstrap's processes have exited), not when the output pipes close: a
detached child that keeps stdout open cannot hold the call, it is killed and counted.

Process mode has no private tmpfs to bound what the call writes, so the parent watches the working
directory (the only place Landlock lets it create files, and where it may not remove any, so no
byte hides in an unlinked open file) every `WATCH_PERIOD_S` and kills the call past `max_disk_mb`
or `max_files`. The bound is not exact: between two looks the call may add what the disk takes in
one period, each file at most `max_file_mb` (RLIMIT_FSIZE, a kernel bound).
"""

from __future__ import annotations

import ast
import asyncio
import os
import shutil
import signal
import stat
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megatron_sao.envs.sandbox_cgroup import CallCgroup, CgroupFactory
from megatron_sao.envs.sandbox_types import SandboxError, SandboxLimits, SandboxResult

_READ_CHUNK = 4096
_EXIT_GRACE_S = 2.0  # after the program's end, how long output pipes may stay open
WATCH_PERIOD_S = 0.025
# A walk takes ~2 us per file, with the GIL held between stat calls: the next look comes after at
# least this many walk durations, so the watch costs a call at most ~1/4 of a core however many
# files it made (at most max_files + one period's worth).
_WATCH_DUTY = 4
# Off the event loop: a walk of thousands of files, and clean-up (rmtree, cgroup rmdir retries),
# would otherwise stall every rollout of the process (they ran on the loop and stalled it 1.6-3.1 s).
_RM = shutil.which("rm")
_WATCHERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sandbox-disk-watch")
# A walk holds one descriptor per level of the current path: both watch threads together at most
# 2 x MAX_DEPTH of the trainer's descriptors. No program needs a deeper working directory.
MAX_DEPTH = 64
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def planned_isolation(mode: str, uid: int | None, limits: SandboxLimits, cg: CallCgroup | None,
                       factory: CgroupFactory | None, workspace: bool = False) -> list[str]:
    """The layers the parent sets up or asks for; the child appends what it installed itself."""
    out = [f"uid={uid}" if uid is not None else ("userns" if mode == "namespaces" else "uid=same")]
    if mode == "namespaces":
        out += ["pidns", "netns", "mountns", "ipcns", "utsns", "rootfs=private", f"disk=tmpfs:{limits.max_disk_mb}m",
                f"files=tmpfs:{limits.max_files}"]
        if workspace:  # the workspace is a host directory: watched, as in process mode (/tmp stays a tmpfs)
            out += ["workspace", f"disk=watched:{limits.max_disk_mb}m", f"files=watched:{limits.max_files}"]
    else:
        out += ["pgroup", "subreaper", f"disk=watched:{limits.max_disk_mb}m", f"files=watched:{limits.max_files}"]
        if workspace:
            out.append("workspace")
        if uid is None:
            out.append("parent=nondumpable")
    if cg is not None:
        out += [f"memory={factory.kind}:{limits.memory_mb}m", f"pids={factory.kind}:{limits.max_processes}"]
    else:
        out.append(f"memory=per-process:{limits.memory_mb}m")
    out.append(f"file-size=rlimit:{limits.max_file_mb}m")
    nproc_scope = "uid" if uid is not None else ("userns" if mode == "namespaces" else "uid+running")
    out.append(f"nproc={nproc_scope}:{limits.max_processes}")
    return out


class StatusReader:
    """Reads the bootstrap's status pipe (a Python literal per line) until every writer has closed it."""

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
                    self.msgs.append(ast.literal_eval(line.decode()))
                except (ValueError, SyntaxError):
                    pass
        finally:
            transport.close()

    def get(self, key: str):
        return next((m[key] for m in self.msgs if key in m), None)

    def final(self) -> dict:
        return next((m for m in self.msgs if "leftovers" in m), {})


class _Tally:
    """What a walk of the working directory has counted so far."""

    def __init__(self, max_entries: int) -> None:
        self.bytes, self.entries, self.max_entries = 0, 0, max_entries
        self.inodes: set[int] = set()  # hard-linked files seen (their blocks count once)

    def scan(self, fd: int) -> list[str] | None:
        """Count the entries of the directory open as `fd`; its subdirectories' names, or None once
        past `max_entries`. Raises OSError (but not for an entry removed meanwhile)."""
        subdirs = []
        with os.scandir(fd) as it:  # listed and stat'ed relative to `fd` (fstatat), never by path
            for e in it:
                self.entries += 1
                if self.entries > self.max_entries:
                    return None
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    subdirs.append(e.name)
                elif st.st_nlink > 1:
                    if st.st_ino in self.inodes:
                        continue
                    self.inodes.add(st.st_ino)
                self.bytes += st.st_blocks * 512
        return subdirs


def workdir_usage(root: str, max_entries: int) -> tuple[int, int, str | None]:
    """(bytes allocated, entries, why the walk could not finish) below `root`; stops counting past
    `max_entries`.

    By directory descriptors, never by path strings: each directory is opened relative to its
    parent's descriptor with O_NOFOLLOW | O_DIRECTORY and listed through it, so a tree whose paths
    exceed PATH_MAX is walked like any other, and a directory swapped for a symlink between the
    listing and the open is refused by the kernel (ELOOP), never followed. The walk changes nothing:
    no chmod of a directory the code made unreadable (a path the code controls must lead this process
    nowhere). Only ENOENT is benign (the call removed a directory meanwhile); any other error, or a
    tree deeper than `MAX_DEPTH` (each level holds a descriptor), is the reason returned, and the
    call is killed."""
    tally = _Tally(max_entries)
    frames: list[tuple[int, str, list[str]]] = []  # the open directories of the current path
    try:
        try:
            top = os.open(root, _DIR_FLAGS)
        except OSError as e:
            return 0, 0, f"cannot open the working directory ({e.strerror})"
        frames.append((top, ".", []))
        subdirs = tally.scan(top)
        while subdirs is not None:
            frames[-1][2].extend(subdirs)
            while frames and not frames[-1][2]:  # done with the deepest directory
                os.close(frames.pop()[0])
            if not frames:
                break
            parent, rel, pending = frames[-1]
            name = pending.pop()
            where = f"{rel}/{name}"
            if len(frames) >= MAX_DEPTH:
                return tally.bytes, tally.entries, f"the call made a tree deeper than {MAX_DEPTH} directories"
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
            except FileNotFoundError:  # removed meanwhile
                subdirs = []
                continue
            except OSError as e:  # EACCES (made unreadable), ELOOP (swapped for a symlink), ...
                return tally.bytes, tally.entries, f"cannot open {_shown(where)} ({e.strerror})"
            frames.append((fd, where, []))
            subdirs = tally.scan(fd)
        return tally.bytes, tally.entries, None
    except OSError as e:
        where = frames[-1][1] if frames else "."
        return tally.bytes, tally.entries, f"cannot read {_shown(where)} ({e.strerror})"
    finally:
        for fd, _, _ in frames:
            os.close(fd)


def _shown(rel: str) -> str:
    """A path of the working directory for a message (the code may make it very long)."""
    return rel if len(rel) <= 200 else f"{rel[:90]}...{rel[-90:]}"


async def watch_disk(workdir: str, limits: SandboxLimits) -> str:
    """Returns why the call must end, once its working directory passes a limit (process mode)."""
    loop = asyncio.get_running_loop()
    pause = WATCH_PERIOD_S
    while True:
        await asyncio.sleep(pause)
        t0 = time.monotonic()
        used, n, problem = await loop.run_in_executor(_WATCHERS, workdir_usage, workdir, limits.max_files + 1)
        pause = max(WATCH_PERIOD_S, _WATCH_DUTY * (time.monotonic() - t0))
        if problem is not None:
            return f"disk watch: {problem}"
        if used > limits.max_disk_mb << 20:
            return f"disk limit of {limits.max_disk_mb} MiB exceeded"
        if n > limits.max_files + 1:  # + main.py
            return f"file count limit of {limits.max_files} exceeded"


async def collect(proc: asyncio.subprocess.Process, status: StatusReader, limits: SandboxLimits, t0: float,
                   cg: CallCgroup | None, watch_dir: str | None = None) -> SandboxResult:
    """Read both streams under the output cap and the wall clock until the program ends (the
    status pipe closes when the bootstrap is done); kill the call's processes on either limit, or
    when `watch_dir` (process mode) passes the disk limits."""
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
    disk = asyncio.ensure_future(watch_disk(watch_dir, limits) if watch_dir else asyncio.Event().wait())
    done, _ = await asyncio.wait({status.done, overflow, disk}, timeout=limits.wall_time_s,
                                 return_when=asyncio.FIRST_COMPLETED)
    reason = None
    if status.done not in done:
        reason = "output_limit" if overflow in done else disk.result() if disk in done else "wall_timeout"
    else:  # the program ended: its output is complete once the pipes close
        await asyncio.wait({pumps}, timeout=_EXIT_GRACE_S)
    if reason is not None or not pumps.done():
        await _kill_call(proc.pid, status.get("child"), cg)
    await proc.wait()
    await asyncio.wait({pumps, status.done}, timeout=_EXIT_GRACE_S)
    for f in (pumps, status.done, overflow, disk):
        f.cancel()
    await asyncio.gather(pumps, status.done, overflow, disk, return_exceptions=True)
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
    elif reason is not None:  # the disk watch said why
        pass
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


async def _kill_call(pid: int, child: int | None, cg: CallCgroup | None) -> None:
    """Kill the bootstrap's group (A and the PID namespace's init B: the kernel then kills the rest of
    the namespace), the user process's own group (process mode), and the cgroup."""
    for group in (pid, child):
        if group:
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    if cg is not None:  # cgroup v1 kills in rounds until the group is empty
        await asyncio.to_thread(cg.kill_all)


async def kill_all_of_uid(uid: int) -> None:
    """Kill every process of a private sandbox uid (process mode: catches anything left anywhere).
    The helper drops to the uid itself: Popen(user=...) would fork the whole trainer (page tables
    of every mapping, with the GIL held, on the event loop); without it the launch is a vfork."""
    drop_and_kill = f"import os; os.setgroups([]); os.setgid({uid}); os.setuid({uid}); os.kill(-1, 9)"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", "-c", drop_and_kill, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, env={}, close_fds=True)
    await proc.wait()  # exit status 1 (ProcessLookupError) just means there was nothing left to kill


async def remove_tree(path: Path) -> None:
    """Remove a directory the sandbox's code wrote, off the event loop (thousands of files at worst)."""
    if _RM is not None:  # another process: no GIL held against the rollouts for thousands of unlinks
        quiet = asyncio.subprocess.DEVNULL
        rm = await asyncio.create_subprocess_exec(_RM, "-rf", "--one-file-system", "--", str(path), stdin=quiet,
                                                  stdout=quiet, stderr=quiet, env={}, close_fds=True)
        await rm.wait()
    if os.path.lexists(path):  # no rm, or directories the code made unreadable
        await asyncio.to_thread(_remove_tree, path)


def _remove_tree(path: Path) -> None:
    """rmtree that first opens up directories the code made unreadable (its own uid may chmod)."""
    def reopen(func, p, _exc):
        try:
            os.chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
                shutil.rmtree(p, ignore_errors=True)
            else:
                func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=reopen)
