"""Process-level isolation primitives for the sandbox child: namespaces, prctl, capabilities, rlimits."""

from __future__ import annotations

import ctypes
import os
import resource

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
NAMESPACES = {"mountns": CLONE_NEWNS, "utsns": CLONE_NEWUTS, "ipcns": CLONE_NEWIPC,
              "pidns": CLONE_NEWPID, "netns": CLONE_NEWNET, "cgroupns": CLONE_NEWCGROUP}
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sandbox: {what}: {os.strerror(err)}")


def prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, value, 0, 0, 0), f"prctl({option}, {value})")


def die_with_parent(parent: int | None = None) -> None:
    """SIGKILL this process when its parent dies; `parent` (its pid, as this process sees it) is
    checked afterwards in case it died before the prctl."""
    prctl(PR_SET_PDEATHSIG, 9)  # SIGKILL (the signal module would import enum: startup cost)
    if parent is not None and os.getppid() != parent:
        os._exit(125)


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), f"unshare({flags:#x})")


def enter_user_namespace(inside_id: int) -> None:
    """A new user namespace in which this process's uid/gid appear as `inside_id` (an unprivileged
    process may map exactly its own ids). The process holds every capability in the new namespace
    until it drops them (`drop_capabilities`) or execs as non-root."""
    uid, gid = os.geteuid(), os.getegid()
    unshare(CLONE_NEWUSER)
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{inside_id} {uid} 1\n")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{inside_id} {gid} 1\n")


def drop_capabilities() -> None:
    """Empty the effective, permitted and inheritable sets (capset, version 3)."""
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(_libc.capset(header, data), "capset")


def drop_to(uid: int, gid: int) -> None:
    """Root only: become `uid`/`gid` for good (no supplementary groups, no capabilities left)."""
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError("sandbox: failed to drop privileges")


def set_limits(lim: dict, nproc: int | None) -> None:
    def cap(res, soft, hard=None):
        resource.setrlimit(res, (soft, soft if hard is None else hard))

    cap(resource.RLIMIT_CPU, lim["cpu_s"], lim["cpu_s"] + 1)  # SIGXCPU first, SIGKILL 1 s later
    cap(resource.RLIMIT_AS, lim["memory_mb"] << 20)
    cap(resource.RLIMIT_FSIZE, lim["fsize_mb"] << 20)
    cap(resource.RLIMIT_NOFILE, lim["nofile"])
    cap(resource.RLIMIT_CORE, 0)  # SIGXCPU would otherwise dump core into the workdir
    if nproc is not None:
        cap(resource.RLIMIT_NPROC, nproc)


def tasks_of_uid(uid: int) -> int:
    """Threads of `uid` on the host now: RLIMIT_NPROC counts them all, so a same-uid sandbox sets its
    limit to this plus its own budget."""
    n = 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                st = os.stat(f"/proc/{d}/task")
                if st.st_uid == uid:
                    n += st.st_nlink - 2
            except OSError:
                pass
    return n


def processes_in_group(pgid: int, exclude: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != exclude:
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def live_processes(exclude: int) -> list[int]:
    """Processes of this PID namespace other than `exclude` (run inside it, with its own /proc)."""
    return [int(d) for d in os.listdir("/proc") if d.isdigit() and int(d) != exclude
            and not _is_zombie(int(d))]


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True
