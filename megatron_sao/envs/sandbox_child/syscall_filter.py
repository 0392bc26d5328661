"""A seccomp filter for the sandbox, written as a small classic-BPF program and loaded with prctl.

Why our own ~150 lines and not a library: the Python bindings of libseccomp are not on PyPI in a
maintained form (the official `seccomp` module is built from the libseccomp source tree; the PyPI
forks are unmaintained or one-person projects), and the filter we need is a short deny list plus
three argument checks, which classic BPF expresses directly. The syscall numbers are those of the
kernel's unistd tables for x86_64 and aarch64 (the architectures our clusters run); on another
architecture `install` raises and the sandbox reports that seccomp is not active.

What it denies (EPERM unless noted):
- always: namespace and mount syscalls (unshare, setns, mount, pivot_root, the new mount API,
  clone with namespace flags; clone3 gets ENOSYS so libc falls back to clone, whose flags a BPF
  filter can read), ptrace and process_vm_readv/writev, bpf, perf_event_open, userfaultfd,
  io_uring, keyrings, kernel modules, kexec, open_by_handle_at, swap, reboot, clock setting, syslog;
  any other architecture's syscalls (x32 on x86_64) are refused, a foreign arch kills the process.
- process mode only (no user/PID/IPC/network namespace around the call; the code may share the
  trainer's uid, so everything the kernel allows between processes of one uid must be cut here):
  - signals to anything but the call's own process group (kill with pid 0 or -pgid, tgkill on the
    call's first process), every other signal-sending syscall and pidfd, leaving the process group
    (setsid, setpgid), asking for SIGIO/SIGURG to another process (fcntl F_SETOWN/F_SETOWN_EX,
    ioctl FIOSETOWN/SIOCSPGRP/TIOCSPGRP/TIOCSTI);
  - every socket(): no TCP/UDP, and no unix socket, so no connect to a same-uid server at a known
    path (a tmux or screen server, the systemd user manager, the D-Bus session bus); Landlock does
    not govern connecting to path-named sockets. socketpair stays, AF_UNIX + SOCK_STREAM only (a
    connected pair cannot be pointed anywhere else); connect and bind are refused outright;
  - resource and scheduling syscalls on another process: prlimit64, sched_setaffinity,
    sched_setscheduler, sched_setparam, sched_setattr, migrate_pages and move_pages only with pid 0
    (the caller itself), setpriority only as (PRIO_PROCESS, 0), ioprio_set only as
    (IOPRIO_WHO_PROCESS, 0). A BPF filter compares argument values with constants and cannot know
    the caller's pid, so "self" is the value 0, which is how glibc's setrlimit, nice and Python's
    os.sched_setaffinity(0, ...) call them; naming even one's own pid explicitly is refused;
  - execve and execveat: the filter is installed in the already running interpreter, so the call
    can fork but never start another program (a shell, tmux, a setuid binary); except for a
    workspace's shell commands (`allow_exec`, envs/sandbox_workspace.py), which run programs from the
    system directories under this same filter, Landlock and no_new_privs (so no setuid gain, no
    socket, no signal outside the group: what a started program may do is what the call may do);
  - SysV IPC and POSIX message queues (other processes of the uid may hold segments), kcmp,
    process_madvise, process_mrelease, memfd_create (unnamed memory outside the disk watch and
    outside RLIMIT_AS until mapped), open/openat with O_TMPFILE (an unnamed file the disk watch
    cannot see), openat2 (ENOSYS: its flags sit in a struct the filter cannot read; libc falls back);
  - chmod, chown and extended-attribute writes of any file (Landlock does not govern them, and as
    the user's own uid they would reach every file of the user: `chmod 644 ~/.ssh/id_rsa`); so
    shutil.copy/copy2, which copy the mode, fail in this mode (shutil.copyfile works). A workspace
    under a private uid (root) may chmod, chown and set timestamps (`allow_modes`): that uid owns
    nothing but the workspace, and the kernel lets a non-root uid change only its own files;
  - for the same reason, setting a file's timestamps by path: utime, utimes, futimesat, and
    utimensat unless its path is NULL (futimens on a descriptor, which Landlock checked when the
    file was opened).
- namespaces mode only: socket() of the families the call's network namespace governs (AF_UNIX,
  AF_INET, AF_INET6), socketpair of AF_UNIX; any other family gets EAFNOSUPPORT. AF_VSOCK in
  particular is not namespaced: on a VM with virtio-vsock (most cloud and microVM nodes) it would
  reach the host's vsock port space. (Process mode refuses every socket().)
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct

_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_BIT = 0x40000000

_SYSCALLS = {
    "x86_64": dict(
        ptrace=101, process_vm_readv=310, process_vm_writev=311, mount=165, umount2=166, pivot_root=155,
        chroot=161, unshare=272, setns=308, bpf=321, perf_event_open=298, userfaultfd=323, keyctl=250,
        add_key=248, request_key=249, kexec_load=246, kexec_file_load=320, init_module=175,
        finit_module=313, delete_module=176, open_by_handle_at=304, name_to_handle_at=303, iopl=172,
        ioperm=173, swapon=167, swapoff=168, reboot=169, syslog=103, acct=163, quotactl=179,
        settimeofday=164, clock_settime=227, clock_adjtime=305, adjtimex=159, lookup_dcookie=212,
        io_uring_setup=425, io_uring_enter=426, io_uring_register=427, open_tree=428, move_mount=429,
        fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442, vhangup=153,
        sethostname=170, setdomainname=171, clone=56, clone3=435, kill=62, tkill=200, tgkill=234,
        rt_sigqueueinfo=129, rt_tgsigqueueinfo=297, pidfd_open=434, pidfd_send_signal=424,
        pidfd_getfd=438, setsid=112, setpgid=109, socket=41, socketpair=53, connect=42, bind=49,
        execve=59, execveat=322, prlimit64=302, setpriority=141, sched_setaffinity=203, sched_setscheduler=144,
        sched_setparam=142, sched_setattr=314, ioprio_set=251, migrate_pages=256, move_pages=279, shmget=29,
        shmat=30, shmctl=31, msgget=68, msgsnd=69, msgrcv=70, msgctl=71, semget=64, semop=65, semctl=66,
        semtimedop=220, mq_open=240, mq_unlink=241, mq_timedsend=242, mq_timedreceive=243, mq_notify=244,
        mq_getsetattr=245, kcmp=312, process_madvise=440, process_mrelease=448, memfd_create=319,
        memfd_secret=447, fcntl=72, ioctl=16, open=2, openat=257, openat2=437, chmod=90, fchmod=91,
        fchmodat=268, fchmodat2=452, chown=92, fchown=93, lchown=94, fchownat=260, setxattr=188, lsetxattr=189,
        fsetxattr=190, removexattr=197, lremovexattr=198, fremovexattr=199, setxattrat=463, removexattrat=466,
        utime=132, utimes=235, futimesat=261, utimensat=280),
    "aarch64": dict(
        ptrace=117, process_vm_readv=270, process_vm_writev=271, mount=40, umount2=39, pivot_root=41,
        chroot=51, unshare=97, setns=268, bpf=280, perf_event_open=241, userfaultfd=282, keyctl=219,
        add_key=217, request_key=218, kexec_load=104, kexec_file_load=294, init_module=105,
        finit_module=273, delete_module=106, open_by_handle_at=265, name_to_handle_at=264,
        swapon=224, swapoff=225, reboot=142, syslog=116, acct=89, quotactl=60, settimeofday=170,
        clock_settime=112, clock_adjtime=266, adjtimex=171, lookup_dcookie=18, io_uring_setup=425,
        io_uring_enter=426, io_uring_register=427, open_tree=428, move_mount=429, fsopen=430,
        fsconfig=431, fsmount=432, fspick=433, mount_setattr=442, vhangup=58, sethostname=161,
        setdomainname=162, clone=220, clone3=435, kill=129, tkill=130, tgkill=131, rt_sigqueueinfo=138,
        rt_tgsigqueueinfo=240, pidfd_open=434, pidfd_send_signal=424, pidfd_getfd=438, setsid=157,
        setpgid=154, socket=198, socketpair=199, connect=203, bind=200, execve=221, execveat=281,
        prlimit64=261, setpriority=140, sched_setaffinity=122, sched_setscheduler=119, sched_setparam=118,
        sched_setattr=274, ioprio_set=30, migrate_pages=238, move_pages=239, shmget=194, shmctl=195, shmat=196,
        msgget=186, msgctl=187, msgrcv=188, msgsnd=189, semget=190, semctl=191, semtimedop=192, semop=193,
        mq_open=180, mq_unlink=181, mq_timedsend=182, mq_timedreceive=183, mq_notify=184, mq_getsetattr=185,
        kcmp=272, process_madvise=440, process_mrelease=448, memfd_create=279, memfd_secret=447, fcntl=25,
        ioctl=29, openat=56, openat2=437, fchmod=52, fchmodat=53, fchmodat2=452, fchownat=54, fchown=55,
        setxattr=5, lsetxattr=6, fsetxattr=7, removexattr=14, lremovexattr=15, fremovexattr=16, setxattrat=463,
        removexattrat=466, utimensat=88),
}
_ALWAYS = ("ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot",
           "unshare", "setns", "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
           "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
           "open_by_handle_at", "name_to_handle_at", "iopl", "ioperm", "swapon", "swapoff", "reboot",
           "syslog", "acct", "quotactl", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
           "lookup_dcookie", "io_uring_setup", "io_uring_enter", "io_uring_register", "open_tree",
           "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "vhangup",
           "sethostname", "setdomainname")
_SAME_UID = ("tkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_open", "pidfd_send_signal",
             "pidfd_getfd", "setsid", "setpgid", "connect", "bind", "execve", "execveat", "shmget", "shmat",
             "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semctl", "semtimedop",
             "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr", "kcmp",
             "process_madvise", "process_mrelease", "memfd_create", "memfd_secret", "chmod", "fchmod",
             "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat", "setxattr", "lsetxattr",
             "fsetxattr", "removexattr", "lremovexattr", "fremovexattr", "setxattrat", "removexattrat",
             "utime", "utimes", "futimesat")
_MODES = ("chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat", "utime", "utimes",
          "futimesat")  # and utimensat with a path, which the filter otherwise checks below
# process mode: allowed only when the first argument is 0 (the calling process itself)
_SELF_ONLY = ("prlimit64", "sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr",
              "migrate_pages", "move_pages")
_PRIO_PROCESS, _IOPRIO_WHO_PROCESS = 0, 1
_F_SETOWN, _F_SETOWN_EX = 8, 15
_OWNER_IOCTLS = (0x8901, 0x8902, 0x5410, 0x5412)  # FIOSETOWN, SIOCSPGRP, TIOCSPGRP, TIOCSTI
_O_TMPFILE = 0x400000  # __O_TMPFILE, the same bit on x86_64 and aarch64
_SOCK_TYPE_MASK, _SOCK_STREAM = 0xF, 1
_CLONE_NS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
_AF_UNIX, _AF_INET, _AF_INET6 = 1, 2, 10
# Namespaces mode: the socket families the call's own network namespace governs. AF_VSOCK (the
# host's virtio-vsock port space), AF_PACKET, AF_NETLINK's non-namespaced protocols, AF_BLUETOOTH,
# AF_ALG, ... are not, or are kernel attack surface no program here needs.
_NS_SOCKET_FAMILIES = (_AF_UNIX, _AF_INET, _AF_INET6)

# classic BPF opcodes
_LD_ABS, _JEQ, _JGE, _JSET, _RET, _AND = 0x20, 0x15, 0x35, 0x45, 0x06, 0x54
_ALLOW, _KILL_PROCESS, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_NR, _ARCH_OFF = 0, 4


def _arg(i: int) -> int:
    return 16 + 8 * i  # low 32 bits of args[i] (little-endian); int arguments live there


class _Program:
    """Instructions with symbolic jump targets, resolved to relative offsets at the end."""

    def __init__(self) -> None:
        self.ins: list[list] = []
        self.labels: dict[str, int] = {}

    def emit(self, code: int, k: int = 0, jt: int | str = 0, jf: int | str = 0) -> None:
        self.ins.append([code, jt, jf, k & 0xFFFFFFFF])

    def label(self, name: str) -> None:
        self.labels[name] = len(self.ins)

    def ret(self, value: int) -> None:
        self.emit(_RET, value)

    def assemble(self) -> bytes:
        out = []
        for i, (code, jt, jf, k) in enumerate(self.ins):
            jt, jf = (self.labels[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf))  # forward only
            if not (0 <= jt < 256 and 0 <= jf < 256):
                raise ValueError(f"seccomp program: jump out of range at {i}")
            out.append(struct.pack("=HBBI", code, jt, jf, k))
        return b"".join(out)


def build(same_uid: bool = False, pgid: int = 0, machine: str | None = None, allow_exec: bool = False,
          allow_modes: bool = False) -> bytes:
    """The filter program for this machine; `pgid` is the call's process group (same-uid mode);
    `allow_exec` keeps execve/execveat open in same-uid mode (a workspace's shell commands);
    `allow_modes` keeps chmod, chown and timestamps open there (a workspace under a private uid, which owns no file
    but the workspace's: git sets modes on its lock files)."""
    machine = machine or os.uname().machine
    if machine not in _ARCH:
        raise OSError(errno.ENOSYS, f"no seccomp syscall table for {machine}")
    nr = _SYSCALLS[machine]
    p = _Program()
    eperm, enosys = _ERRNO | errno.EPERM, _ERRNO | errno.ENOSYS
    p.emit(_LD_ABS, _ARCH_OFF)
    p.emit(_JEQ, _ARCH[machine], 1, 0)
    p.ret(_KILL_PROCESS)
    p.emit(_LD_ABS, _NR)
    if machine == "x86_64":
        p.emit(_JGE, _X32_BIT, "deny", 0)
    denied = _ALWAYS + (_SAME_UID if same_uid else ())
    opened = (("execve", "execveat") if allow_exec else ()) + (_MODES if allow_modes else ())
    denied = tuple(n for n in denied if n not in opened)
    for name in denied:
        if name in nr:
            p.emit(_JEQ, nr[name], "deny", 0)
    p.emit(_JEQ, nr["clone3"], "nosys", 0)
    p.emit(_JEQ, nr["clone"], "clone", 0)
    if not same_uid:
        p.emit(_JEQ, nr["socket"], "ns_socket", 0)
        p.emit(_JEQ, nr["socketpair"], "ns_socketpair", 0)
    if same_uid:
        p.emit(_JEQ, nr["openat2"], "nosys", 0)
        p.emit(_JEQ, nr["kill"], "kill", 0)
        p.emit(_JEQ, nr["tgkill"], "tgkill", 0)
        p.emit(_JEQ, nr["socket"], "eacces", 0)
        p.emit(_JEQ, nr["socketpair"], "socketpair", 0)
        for name in _SELF_ONLY:
            p.emit(_JEQ, nr[name], "arg0_is_0", 0)
        p.emit(_JEQ, nr["setpriority"], "setpriority", 0)
        p.emit(_JEQ, nr["ioprio_set"], "ioprio_set", 0)
        p.emit(_JEQ, nr["fcntl"], "fcntl", 0)
        p.emit(_JEQ, nr["ioctl"], "ioctl", 0)
        p.emit(_JEQ, nr["openat"], "openat", 0)
        if "open" in nr:
            p.emit(_JEQ, nr["open"], "open", 0)
        if not allow_modes:
            p.emit(_JEQ, nr["utimensat"], "utimensat", 0)
    p.ret(_ALLOW)
    # Argument checks, then the shared verdicts (classic BPF jumps only forward).
    p.label("clone")
    p.emit(_LD_ABS, _arg(0))
    p.emit(_JSET, _CLONE_NS, "deny", "allow")
    if not same_uid:
        p.label("ns_socket")  # socket(family, type, protocol): the allowed families only
        p.emit(_LD_ABS, _arg(0))
        for family in _NS_SOCKET_FAMILIES:
            p.emit(_JEQ, family, "allow", 0)
        p.ret(_ERRNO | errno.EAFNOSUPPORT)
        p.label("ns_socketpair")  # only AF_UNIX has pairs
        p.emit(_LD_ABS, _arg(0))
        p.emit(_JEQ, _AF_UNIX, "allow", 0)
        p.ret(_ERRNO | errno.EAFNOSUPPORT)
    if same_uid:
        p.label("kill")  # kill(pid, sig): only the call's own group (0, -pgid) or its first process (pgid)
        p.emit(_LD_ABS, _arg(0))
        p.emit(_JEQ, 0, "allow", 0)
        p.emit(_JEQ, -pgid, "allow", 0)
        p.emit(_JEQ, pgid, "allow", "deny")
        p.label("tgkill")  # tgkill(tgid, tid, sig): abort() and raise() of the call's first process
        p.emit(_LD_ABS, _arg(0))
        p.emit(_JEQ, pgid, "allow", "deny")
        p.label("socketpair")  # (AF_UNIX, SOCK_STREAM [| SOCK_CLOEXEC | SOCK_NONBLOCK], ...)
        p.emit(_LD_ABS, _arg(0))
        p.emit(_JEQ, _AF_UNIX, 0, "eacces")
        p.emit(_LD_ABS, _arg(1))
        p.emit(_AND, _SOCK_TYPE_MASK)
        p.emit(_JEQ, _SOCK_STREAM, "allow", "eacces")
        p.label("arg0_is_0")
        p.emit(_LD_ABS, _arg(0))
        p.emit(_JEQ, 0, "allow", "deny")
        for name, which in (("setpriority", _PRIO_PROCESS), ("ioprio_set", _IOPRIO_WHO_PROCESS)):
            p.label(name)  # (which, who, value): only (a process, 0 = the caller)
            p.emit(_LD_ABS, _arg(0))
            p.emit(_JEQ, which, "arg1_is_0", "deny")
        p.label("arg1_is_0")
        p.emit(_LD_ABS, _arg(1))
        p.emit(_JEQ, 0, "allow", "deny")
        p.label("fcntl")  # (fd, cmd, arg)
        p.emit(_LD_ABS, _arg(1))
        p.emit(_JEQ, _F_SETOWN, "deny", 0)
        p.emit(_JEQ, _F_SETOWN_EX, "deny", "allow")
        p.label("ioctl")  # (fd, cmd, arg)
        p.emit(_LD_ABS, _arg(1))
        for cmd in _OWNER_IOCTLS:
            p.emit(_JEQ, cmd, "deny", 0)
        p.ret(_ALLOW)
        p.label("open")  # (path, flags, mode)
        p.emit(_LD_ABS, _arg(1))
        p.emit(_JSET, _O_TMPFILE, "deny", "allow")
        p.label("openat")  # (dirfd, path, flags, mode)
        p.emit(_LD_ABS, _arg(2))
        p.emit(_JSET, _O_TMPFILE, "deny", "allow")
        p.label("utimensat")  # (dirfd, path, times, flags): only path NULL, i.e. futimens(fd)
        p.emit(_LD_ABS, _arg(1))
        p.emit(_JEQ, 0, 0, "deny")
        p.emit(_LD_ABS, _arg(1) + 4)  # the pointer's high half
        p.emit(_JEQ, 0, "allow", "deny")
        p.label("eacces")
        p.ret(_ERRNO | errno.EACCES)
    p.label("deny")
    p.ret(eperm)
    p.label("nosys")
    p.ret(enosys)
    p.label("allow")
    p.ret(_ALLOW)
    return p.assemble()


def install(program: bytes) -> None:
    """Load the filter into this process (inherited by every child); sets no_new_privs first."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    buf = ctypes.create_string_buffer(program, len(program))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
