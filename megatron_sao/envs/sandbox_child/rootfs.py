"""The sandbox's own root filesystem, built in a fresh mount namespace and entered with pivot_root.

    /                 a small tmpfs, read-only once built
    /usr /bin /lib*   the host's system directories, bind-mounted read-only (shell, libc, coreutils)
    <python prefix>   the interpreter's install tree (standard library), read-only
    <site-packages>   only with allow_site_packages, read-only
    /etc              a generated passwd/group plus the loader cache and timezone, read-only
    /dev              null zero full random urandom (bind-mounted), fd/std* links; shm -> /tmp
    /proc             a new procfs: only the call's own processes (new PID namespace)
    /tmp              a tmpfs of `disk_mb` and `max_files` inodes: the only writable place, shared by
                      the working directory /tmp/work, so everything the call writes is bounded as a
                      whole, bytes and files (an inode costs kernel memory even when the file is empty)
    /tmp/work         with a workspace (envs/sandbox_workspace.py): that host directory, bind-mounted
                      read-write (nosuid, nodev) over the tmpfs's working directory, so what the call
                      changes there is still there at the next call; the parent's disk watch bounds it
                      (the code itself is then /tmp/.sao-main.py, outside the workspace)

Nothing else of the host is reachable: home directories, the run directory, datasets and answers,
other processes' /proc entries, the trainer's environment. Works as root and, inside a user
namespace, as an ordinary user (binds of existing mounts keep their locked nosuid/nodev flags).
"""

from __future__ import annotations

import ctypes
import os

WORKDIR = "/tmp/work"
WORKSPACE_CODE = "/tmp/.sao-main.py"  # the call's code when the working directory is a workspace
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
_ST_TO_MS = {os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC}
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/localtime", "/etc/alternatives")
DEVICES = ("null", "zero", "full", "random", "urandom")
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sandbox: {what}: {os.strerror(err)}")


def _enc(x):
    return x.encode() if isinstance(x, str) else x


def mount(src, dst: str, fstype, flags: int, data=None) -> None:
    _check(_libc.mount(_enc(src), dst.encode(), _enc(fstype), flags, _enc(data)), f"mount {src} on {dst}")


def _bind_readonly(src: str, dst: str) -> None:
    try:
        mount(src, dst, None, MS_BIND)
    except OSError:  # a user namespace refuses a non-recursive bind over locked submounts
        mount(src, dst, None, MS_BIND | MS_REC)
    locked = sum(ms for st, ms in _ST_TO_MS.items() if os.statvfs(src).f_flag & st)
    mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | locked)


def _bind_writable(src: str, dst: str) -> None:
    """A workspace: read-write, never a setuid binary or a device node, keeping the host's locked flags."""
    mount(src, dst, None, MS_BIND)
    locked = sum(ms for st, ms in _ST_TO_MS.items() if os.statvfs(src).f_flag & st)
    mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | locked)


def _place(root: str, path: str, is_dir: bool) -> str:
    dst = root + path
    if is_dir:
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    return dst


def _expose(root: str, path: str) -> None:
    """Bind `path` read-only at the same place under `root` (a top-level symlink stays a symlink)."""
    if not os.path.lexists(path) or os.path.lexists(root + path):
        return
    if os.path.islink(path) and os.path.dirname(path) == "/":
        os.symlink(os.readlink(path), root + path)
        return
    real = os.path.realpath(path)
    if os.path.isdir(real) or os.path.isfile(real):
        _bind_readonly(real, _place(root, path, os.path.isdir(real)))


def build(root: str, readonly: list[str], disk_mb: int, max_files: int, uid: int, gid: int,
          code: str, workspace: str | None = None) -> str:
    """Make `root` (an empty directory) the call's root filesystem and switch into it (pivot_root);
    returns where the code is inside. `workspace`: a host directory to bind at the working directory.
    Needs CAP_SYS_ADMIN in the mount namespace's owner (root, or the creator of a user namespace)."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=8m,nr_inodes=1024,mode=0755")
    os.umask(0o022)
    for path in list(SYSTEM_DIRS) + sorted(set(readonly)) + list(ETC_FILES):
        _expose(root, path)
    os.makedirs(root + "/etc", exist_ok=True)
    with open(root + "/etc/passwd", "w") as f:
        f.write(f"root:x:0:0::/:/bin/sh\nsandbox:x:{uid}:{gid}::{WORKDIR}:/bin/sh\n")
    with open(root + "/etc/group", "w") as f:
        f.write(f"root:x:0:\nsandbox:x:{gid}:\n")
    dev = root + "/dev"
    os.makedirs(dev)
    for name in DEVICES:
        mount(f"/dev/{name}", _place(root, f"/dev/{name}", False), None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2"), ("shm", "/tmp")):
        os.symlink(target, f"{dev}/{name}")
    os.makedirs(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(root + "/tmp")
    inodes = max_files + 3  # + the tmpfs's root, the working directory, main.py
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_mb}m,nr_inodes={inodes},mode=1777")
    os.makedirs(root + "/var", exist_ok=True)
    os.symlink("/tmp", root + "/var/tmp")
    os.mkdir(root + WORKDIR, 0o700)
    code_path = WORKDIR + "/main.py" if workspace is None else WORKSPACE_CODE
    with open(root + code_path, "w", encoding="utf-8") as f:
        f.write(code)
    if os.geteuid() == 0 and uid != 0:  # root: hand the working directory to the call's private uid
        os.chown(root + WORKDIR, uid, gid)
        os.chown(root + code_path, uid, gid)
    if workspace is not None:  # already the call's uid's (the workspace holds its uid for its lifetime)
        _bind_writable(workspace, root + WORKDIR)
    _pivot_into(root)
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(WORKDIR)
    return code_path


def _pivot_into(root: str) -> None:
    os.chdir(root)
    os.mkdir(".oldroot")
    _check(_libc.syscall(_PIVOT_ROOT[os.uname().machine], b".", b".oldroot"), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.oldroot", MNT_DETACH), "umount the host root")
    os.rmdir("/.oldroot")
