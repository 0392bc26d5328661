"""A sandbox working directory that outlives its calls: the repository an agent edits, command by command.

``pool.open_workspace(source)`` copies ``source`` into a fresh host directory; every
``pool.run(code, limits, workspace=ws)`` (and ``ws.shell(command, limits)``) is an ordinary sandbox call
-- a fresh process tree with every isolation layer of its mode (envs/sandbox.py) -- whose working
directory is that directory, so what one command writes the next one sees. ``ws.close()`` removes it.

What differs from a call without a workspace, and why:

* *Programs.* An agent's commands are shell commands (``sed``, ``python3 -m pytest``, ``git``), so a
  workspace call may start programs from the system directories: in process mode the seccomp filter keeps
  execve open and the audit hook does not refuse spawning. A started program inherits everything the
  kernel enforces on the call (seccomp: no socket, no signal outside the call's group, no prlimit of
  another process; Landlock; no_new_privs, so a setuid binary gains nothing; rlimits; the namespaces).
  Namespaces mode let the call start programs already (its filter never refused execve).
* *Its own uid, for its whole life.* As root every call runs under a private uid; a workspace takes one
  when it opens, its files are that uid's, and every call in it runs as that uid until it closes. In
  process mode that uid's processes are killed after every call, so no command leaves one behind.
* *Disk.* The workspace is a host directory (in namespaces mode bind-mounted over the call's working
  directory), not the call's tmpfs, so the parent's disk watch bounds it in both modes: ``max_disk_mb`` and
  ``max_files`` of each call's limits count the whole workspace, the repository included. Process mode
  also lets the call remove and rename files there (``sed -i`` renames, git does both), which the
  keep-files rule of a plain call forbids; so a file unlinked while open escapes the watch until the call
  ends (at most ``max_file_mb`` per file, RLIMIT_FSIZE, times the open files the call may hold).
* *Reading it back.* The host copies a workspace (``open_workspace(source=ws.path)``: grading runs the
  hidden tests on a fresh copy, never in the agent's) with ``copy_tree``: regular files, directories and
  symlinks as links, never following one, skipping FIFOs, sockets and devices (a FIFO the agent made
  would block the copy), bounded in bytes and files.
"""

from __future__ import annotations

import asyncio
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from megatron_sao.envs.sandbox_call import remove_tree
from megatron_sao.envs.sandbox_child.rootfs import WORKDIR
from megatron_sao.envs.sandbox_types import SandboxError, SandboxLimits, SandboxResult

# The call's code for a shell command: stderr joins stdout (what a terminal shows, and what
# mini-swe-agent's local environment returns), then the interpreter becomes bash, so the command's
# exit status is the call's and no Python process sits between it and the sandbox.
# GIT_CONFIG_NOSYSTEM: process mode's Landlock refuses /etc, and git takes a refused /etc/gitconfig as fatal.
_SHELL_RUNNER = ("import os\nos.dup2(1, 2)\nos.environ['GIT_CONFIG_NOSYSTEM'] = '1'\n"
                 "os.execv('/bin/bash', ['bash', '-c', {command!r}])\n")


class WorkspaceCopyError(SandboxError):
    """A tree is too large to copy into a workspace (or cannot be read)."""


def copy_tree(src: str | os.PathLike, dst: str | os.PathLike, max_bytes: int, max_files: int,
              owner: int | None = None) -> tuple[int, int]:
    """Copy ``src`` into the existing directory ``dst`` without following any symlink: regular files,
    directories and symlinks (as links); FIFOs, sockets and device nodes are skipped. ``owner``: chown
    every entry to that uid/gid. Returns (bytes, entries); raises WorkspaceCopyError past a bound."""
    total, n = 0, 0
    stack = [(os.fspath(src), os.fspath(dst))]
    while stack:
        s_dir, d_dir = stack.pop()
        try:
            entries = list(os.scandir(s_dir))
        except PermissionError:  # a directory the code made unreadable (chmod 000 in its own tree)
            os.chmod(s_dir, 0o700)
            entries = list(os.scandir(s_dir))
        for e in entries:
            n += 1
            if n > max_files:
                raise WorkspaceCopyError(f"workspace copy: more than {max_files} files under {src}")
            target = os.path.join(d_dir, e.name)
            st = e.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(e.path), target)
            elif stat.S_ISDIR(st.st_mode):
                os.mkdir(target, 0o700)
                stack.append((e.path, target))
            elif stat.S_ISREG(st.st_mode):
                total += st.st_size
                if total > max_bytes:
                    raise WorkspaceCopyError(f"workspace copy: more than {max_bytes} bytes under {src}")
                _copy_file(e.path, target, st.st_mode)
            else:
                continue
            if owner is not None:
                os.lchown(target, owner, owner)
    return total, n


def _copy_file(src: str, dst: str, mode: int) -> None:
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except PermissionError:
        os.chmod(src, 0o600)
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, (mode & 0o755) | 0o600)
        try:
            while chunk := os.read(fd, 1 << 20):
                os.write(out, chunk)
        finally:
            os.close(out)
    finally:
        os.close(fd)


def _write_files(root: Path, files: dict[str, str], owner: int | None) -> None:
    for rel, text in files.items():
        parts = Path(rel).parts
        if not parts or Path(rel).is_absolute() or ".." in parts:
            raise ValueError(f"workspace file {rel!r} must be a relative path inside the workspace")
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for name in parts[:-1]:
                fd = _enter_dir(fd, name, owner)
            try:
                st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    raise ValueError(f"workspace file {rel!r} is a directory in the workspace")
                os.unlink(parts[-1], dir_fd=fd)
            except FileNotFoundError:
                pass
            out = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=fd)
            try:
                os.write(out, text.encode())
                if owner is not None:
                    os.fchown(out, owner, owner)
            finally:
                os.close(out)
        finally:
            os.close(fd)


def _enter_dir(parent: int, name: str, owner: int | None) -> int:
    """The directory ``name`` below ``parent`` (an fd; closed), made afresh when it is not a real directory."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=parent)
            raise FileNotFoundError
    except FileNotFoundError:
        os.mkdir(name, 0o755, dir_fd=parent)
        if owner is not None:
            os.chown(name, owner, owner, dir_fd=parent, follow_symlinks=False)
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    finally:
        os.close(parent)


class SandboxWorkspace:
    """A host directory every call of ``pool.run(..., workspace=self)`` works in (module docstring)."""

    def __init__(self, pool: Any, mode: str, path: Path, uid: int | None) -> None:
        self.pool, self.mode, self.path, self.uid = pool, mode, path, uid
        self.closed = False
        self._lock = asyncio.Lock()  # calls in one workspace run one at a time: one agent, one shell

    @classmethod
    async def create(cls, pool: Any, mode: str, uid: int | None, source: str | os.PathLike | None,
                     max_bytes: int, max_files: int) -> SandboxWorkspace:
        path = Path(tempfile.mkdtemp(prefix="sao-workspace-"))
        try:
            if source is not None:
                await asyncio.to_thread(copy_tree, source, path, max_bytes, max_files, uid)
            if uid is not None:
                os.chown(path, uid, uid)
        except BaseException:
            await asyncio.shield(asyncio.ensure_future(remove_tree(path)))
            raise
        return cls(pool, mode, path, uid)

    @property
    def cwd(self) -> str:
        """The working directory as the calls see it (namespaces: their own root filesystem's)."""
        return WORKDIR if self.mode == "namespaces" else str(self.path)

    async def fork(self) -> SandboxWorkspace:
        """A fresh workspace holding a copy of this one as it is now (between two calls)."""
        async with self._lock:
            return await self.pool.open_workspace(self.path)

    async def write_files(self, files: dict[str, str]) -> None:
        """Write ``files`` (relative path -> text) into the workspace from the host, between calls, replacing
        whatever the code left at those paths: a symlink or a file where a directory is needed is removed,
        never followed (the code may have planted ``tests -> /etc``)."""
        async with self._lock:
            await asyncio.to_thread(_write_files, self.path, files, self.uid)

    def check_usable(self, pool: Any) -> None:
        if self.closed:
            raise SandboxError(f"sandbox workspace {self.path} is closed")
        if pool is not self.pool:
            raise SandboxError("a sandbox workspace runs only in the pool that opened it")

    async def run(self, code: str, limits: SandboxLimits | None = None) -> SandboxResult:
        async with self._lock:
            return await self.pool.run(code, limits, workspace=self)

    async def shell(self, command: str, limits: SandboxLimits | None = None) -> SandboxResult:
        """``bash -c command`` in the workspace; stdout and stderr together in ``stdout``."""
        if not isinstance(command, str):
            raise TypeError(f"command must be a str, got {type(command).__name__}")
        return await self.run(_SHELL_RUNNER.format(command=command), limits)

    async def close(self) -> None:
        """Kill what the workspace's uid still runs (process mode), remove the directory, release the uid.
        Idempotent; finishes even when the caller is cancelled."""
        if self.closed:
            return
        self.closed = True
        await asyncio.shield(asyncio.ensure_future(self.pool.close_workspace(self)))

    def __repr__(self) -> str:
        return f"SandboxWorkspace({str(self.path)!r}, mode={self.mode}, uid={self.uid})"
