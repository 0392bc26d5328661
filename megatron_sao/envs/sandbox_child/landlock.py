"""Landlock (Linux 5.13+): kernel-enforced file access limits any unprivileged process can set on itself.

Process mode (no namespaces) uses it: the call may read and execute only below `read_roots` and
the system library directories, create and write only below its working directory, where it may not
remove or rename a regular file (`keep_files`: an unlinked file still open would hold disk that the
parent's disk watch cannot see; a workspace, where an agent edits a repository with `sed -i` and git,
allows it and states the weaker disk bound, envs/sandbox_workspace.py), and -- with ABI 4+ -- make
no TCP connection, with ABI 6+ send no signal and reach no abstract unix socket outside its own
processes. Process mode as the trainer's
own uid refuses to run without Landlock (file access would then rest on an audit hook, which one
line of Python switches off); as root (a private uid) it runs and `isolation` says no-landlock.
"""

from __future__ import annotations

import ctypes
import os
import struct

_CREATE, _ADD_RULE, _RESTRICT = 444, 445, 446  # same numbers on x86_64 and aarch64
_VERSION_FLAG = 1
_PATH_BENEATH = 1
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_WRITES = sum(1 << i for i in range(4, 13))  # remove/make dir, file, sock, fifo, dev, symlink
REMOVE_FILE = 1 << 5
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX, SCOPE_SIGNAL = 1 << 0, 1 << 1
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/etc/ld.so.cache")
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def abi() -> int:
    """The kernel's Landlock ABI version, 0 where Landlock is missing or disabled."""
    v = _libc.syscall(_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(_VERSION_FLAG))
    return max(int(v), 0)


def _fs_mask(version: int) -> int:
    mask = EXECUTE | WRITE_FILE | READ_FILE | READ_DIR | _WRITES
    if version >= 2:
        mask |= REFER
    if version >= 3:
        mask |= TRUNCATE
    if version >= 5:
        mask |= IOCTL_DEV
    return mask


def restrict(workdir: str, read_roots: list[str], keep_files: bool = True) -> str:
    """Restrict this process (and its future children) for good; returns what is enforced."""
    version = abi()
    if version < 1:
        raise OSError("Landlock is not available")
    fs = _fs_mask(version)
    net = NET_BIND_TCP | NET_CONNECT_TCP if version >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL if version >= 6 else 0
    attr = struct.pack("=QQQ", fs, net, scoped)[: 8 if version < 4 else 16 if version < 6 else 24]
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = _libc.syscall(_CREATE, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    try:
        read = EXECUTE | READ_FILE | READ_DIR
        for path in list(SYSTEM_DIRS) + list(read_roots):
            _allow(ruleset, path, read)
        for path in DEVICES:
            _allow(ruleset, path, READ_FILE | WRITE_FILE)
        _allow(ruleset, workdir, fs & ~REMOVE_FILE if keep_files else fs)
        if _libc.syscall(_RESTRICT, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self (is no_new_privs set?)")
    finally:
        os.close(ruleset)
    return (f"landlock=abi{version}:fs" + (",keep-files" if keep_files else "") + (",tcp" if net else "")
            + (",signals,abstract-unix" if scoped else ""))


def _allow(ruleset: int, path: str, access: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # not on this host
    try:
        if not os.path.isdir(path):  # files take only file rights
            access &= EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV
        rule = ctypes.create_string_buffer(struct.pack("=Qi", access, fd), 12)
        if _libc.syscall(_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_PATH_BENEATH), rule, ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
    finally:
        os.close(fd)
