"""Child-side bootstrap of the Python sandbox: sets up isolation, then runs the untrusted main.py.

``sandbox.py`` starts ``python -I -B [-S] -c <stub> <config>`` in a fresh session; the stub puts
``envs/`` and ``envs/sandbox_child/`` on sys.path and calls ``main()`` here, which imports the
helpers as top-level modules (the package itself is never imported in the child). This code is trusted
and standard-library only.
It reports on a status pipe (fd ``status_fd``, one Python literal per line, never seen by the
untrusted code):
``{"child": pid}``, ``{"ready": [isolation layers]}``, ``{"exit": code, "signal": n, "leftovers": n}``
or ``{"error": message}``.

Namespaced mode (root, or any user where user namespaces work; chosen by sandbox.py) -- three processes:
  A  the process the parent started: joins the call's cgroup (root), enters a user namespace
     (non-root) and new mount/PID/network/IPC/UTS/cgroup namespaces, forks B, waits, exits.
  B  PID 1 of the new PID namespace: builds the private root filesystem (sandbox_child/rootfs.py),
     drops its capabilities (user namespace) and becomes non-dumpable, forks C, reaps everything,
     and when C ends reports how many processes C left behind and exits -- the kernel then kills
     every process left in the namespace, however it daemonized (fork + setsid included).
  C  the untrusted code's process: a session and process group of its own (not A's and B's),
     rlimits, a private uid (root) or no capabilities (user namespace), no_new_privs, the seccomp
     filter (socket families of the network namespace only), audit hooks for clear network errors.
Process mode (no namespaces possible: root in a container without CAP_SYS_ADMIN, or a non-root
user without user namespaces whose config allowed running as its own uid) -- two processes:
  A  a non-dumpable child subreaper that forks C, and when C ends kills C's process group and
     reaps it.
  C  its own process group, a private uid as root, rlimits (as the trainer's own uid RLIMIT_NPROC
     is "the uid's tasks now + the call's budget"), Landlock (file access below the standard
     library and the working directory only, no file removal there; TCP, signals and abstract unix
     sockets scoped on newer kernels; required as the trainer's own uid), and the process-mode
     seccomp filter (sandbox_child/syscall_filter.py: no leaving the group or signalling outside it,
     no socket() at all, no prlimit/renice/affinity/ioprio of another process, no exec, no SysV IPC).
     This mode is weaker than namespaces and says so in `isolation`.
Every layer listed in `isolation` is enforced by the kernel (uid, process group, rlimits, no_new_privs,
non-dumpable, Landlock, seccomp, namespaces, cgroup, tmpfs) or by the parent (wall clock, output
cap, the disk watch of process mode). The audit hook installed in C only turns refusals into clear
messages: one line of Python can switch it off, so nothing relies on it and `isolation` omits it.
"""

import marshal
import os
import sys

# Imports cost most of a call's startup: only os, sys, marshal (built in), ctypes, resource, struct and
# errno are loaded before the user's code; the config travels marshalled (same interpreter on both
# sides), status lines are Python literals (no json, re, enum), signal numbers are Linux's.
SIGKILL = 9
AF_INET, AF_INET6 = 2, 10

INSIDE_ID = 1000  # the call's uid/gid inside its user namespace
_ALLOWED_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_PATH_EVENTS = {"os.mkdir", "os.remove", "os.rmdir", "os.symlink", "os.link", "os.rename",
                "os.chmod", "os.chown", "os.truncate", "os.utime", "shutil.rmtree",
                "shutil.copyfile", "shutil.move"}
_READ_EVENTS = {"os.listdir", "os.scandir", "glob.glob", "os.chdir"}
_SPAWN_EVENTS = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
                 "pty.spawn", "ctypes.dlopen", "ctypes.cdata", "os.forkpty"}


class _Status:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def send(self, **msg) -> None:
        os.write(self.fd, (repr(msg) + "\n").encode())


# ---------------------------------------------------------------------- namespaced mode
def _run_namespaced(cfg: dict, status: _Status) -> str:
    import process  # sandbox_child/process.py (see the stub)

    process.die_with_parent()
    _join_cgroup(cfg)
    with open(cfg["code_file"], encoding="utf-8") as f:
        code = f.read()
    if cfg["userns"]:
        process.enter_user_namespace(INSIDE_ID)
    flags = 0
    for flag in process.NAMESPACES.values():
        flags |= flag
    try:
        process.unshare(flags)
    except OSError:  # kernels without cgroup namespaces
        process.unshare(flags & ~process.CLONE_NEWCGROUP)
    init = os.fork()
    if init == 0:
        return _init(cfg, code, status)  # its parent is outside its PID namespace: getppid() is 0 there
    os.waitpid(init, 0)
    os._exit(0)


def _init(cfg: dict, code: str, status: _Status) -> str:
    """B: PID 1 of the call's namespace. Returns only in C (the path of the code to run)."""
    try:
        import process
        import rootfs
        import syscall_filter  # noqa: F401  (its file is not visible once the root is switched)

        process.die_with_parent(0)
        uid = cfg["uid"] if cfg["uid"] is not None else INSIDE_ID
        lim = cfg["limits"]
        code_path = rootfs.build(cfg["workdir"], cfg["readonly"], lim["disk_mb"], lim["files"], uid, uid, code,
                                 cfg.get("workspace"))
        process.prctl(process.PR_SET_DUMPABLE, 0)
        if cfg["userns"]:
            process.drop_capabilities()
        child = os.fork()
    except BaseException as e:  # reported to the parent, then out
        status.send(error=f"{type(e).__name__}: {e}")
        os._exit(125)
    if child == 0:
        _user_process(cfg, status, workdir=rootfs.WORKDIR, pgid=None, parent=1)
        return code_path
    while True:  # PID 1 reaps every orphan of the namespace
        pid, st = os.waitpid(-1, 0)
        if pid == child:
            break
    left = process.live_processes(exclude=os.getpid())
    status.send(**_exit_of(st), leftovers=len(left))
    os._exit(0)  # the kernel now SIGKILLs whatever is left in the namespace


# ---------------------------------------------------------------------- process mode
def _run_process_mode(cfg: dict, status: _Status) -> str:
    import landlock  # noqa: F401  (loaded before the user's process needs it)
    import process
    import syscall_filter  # noqa: F401

    process.die_with_parent()
    _join_cgroup(cfg)
    process.prctl(process.PR_SET_CHILD_SUBREAPER, 1)
    me = os.getpid()
    process.prctl(process.PR_SET_DUMPABLE, 0)
    child = os.fork()
    if child == 0:
        os.setpgid(0, 0)
        _user_process(cfg, status, workdir=cfg.get("workspace") or cfg["workdir"], pgid=os.getpid(), parent=me)
        return cfg["code_file"]
    status.send(child=child)
    _, st = os.waitpid(child, 0)
    left = process.processes_in_group(child, exclude=os.getpid())
    try:
        os.killpg(child, SIGKILL)
    except ProcessLookupError:
        pass
    while True:  # orphans come to this subreaper
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    status.send(**_exit_of(st), leftovers=len(left))
    os._exit(0)


# ---------------------------------------------------------------------- the untrusted code's process
def _user_process(cfg: dict, status: _Status, workdir: str, pgid: int | None, parent: int) -> None:
    """C: isolation of the untrusted code's process (errors: exit). With a workspace (`cfg["exec"]`)
    the code may start programs: process mode's seccomp filter keeps execve open, Landlock lets it remove
    and rename files in the workspace, and the audit hook does not refuse spawning."""
    import process

    try:
        lim = cfg["limits"]
        process.die_with_parent(parent)
        process_mode = pgid is not None
        if not process_mode:
            # A session (and process group) of its own: A and B stay in the bootstrap's group, which a
            # kill(0) or killpg of the code must not reach (in user-namespace mode the code has A's uid).
            os.setsid()
        same_uid = process_mode and cfg["uid"] is None
        nproc = process.tasks_of_uid(os.getuid()) + lim["nproc"] if same_uid else lim["nproc"]
        process.set_limits(lim, nproc)
        active = list(cfg["isolation"])
        if cfg["uid"] is not None:
            process.drop_to(cfg["uid"], cfg["uid"])
        os.umask(0o077)
        os.chdir(workdir)
        os.environ.update(HOME=workdir, TMPDIR=workdir if process_mode else "/tmp")
        if process_mode:  # no private root filesystem: the kernel limits file access (Landlock)
            import landlock

            process.prctl(process.PR_SET_NO_NEW_PRIVS, 1)
            try:
                active.append(landlock.restrict(workdir, cfg["read_roots"], keep_files=not cfg.get("workspace")))
            except OSError as e:
                if same_uid:  # the only barrier between the code and the user's files: none, no run
                    raise
                active.append(f"no-landlock({e})")
        try:
            import syscall_filter

            allow_exec = bool(cfg.get("exec"))
            private = cfg["uid"] is not None  # a private uid owns no file but the workspace's
            syscall_filter.install(syscall_filter.build(same_uid=process_mode, pgid=pgid or 0, allow_exec=allow_exec,
                                                        allow_modes=allow_exec and private))
            active.append("seccomp" + ("=process" if process_mode else "") + ("+exec" if process_mode and allow_exec
                                                                              else ""))
        except OSError as e:
            if same_uid:  # the only barrier against signalling the trainer: no seccomp, no run
                raise
            active.append(f"no-seccomp({e.strerror})")
        # Not a layer (one line of Python removes it, so `isolation` does not list it): it turns what
        # the kernel layers refuse into clear messages ("network access is disabled").
        _install_audit_hook(workdir, process_mode, cfg["read_roots"], allow_spawn=bool(cfg.get("exec")))
        if cfg.get("interpreter") and os.path.exists(cfg["interpreter"]):
            sys.executable = cfg["interpreter"]
        status.send(ready=active)
    except BaseException as e:
        status.send(error=f"{type(e).__name__}: {e}")
        os._exit(125)
    os.closerange(3, 1 << 16)  # the status pipe and anything else inherited
    for name in ("process", "rootfs", "syscall_filter", "landlock", "sandbox_bootstrap"):
        sys.modules.pop(name, None)
    sys.path[:] = [p for p in sys.path if p not in (cfg["child_path"], os.path.dirname(cfg["child_path"]))]


def _join_cgroup(cfg: dict) -> None:
    for procs in cfg["cgroup_procs"]:  # root: the whole tree is accounted from here on
        with open(procs, "w") as f:
            f.write("0")


def _exit_of(st: int) -> dict:
    if os.WIFSIGNALED(st):
        return {"exit": None, "signal": os.WTERMSIG(st)}
    return {"exit": os.WEXITSTATUS(st), "signal": None}


def _install_audit_hook(workdir: str, restrict_fs: bool, read_roots: list, allow_spawn: bool = False) -> None:
    """Clear messages for what the kernel layers refuse anyway (a hook is not a barrier: the code can
    clear it). Network: IPv4/IPv6. Process mode also: reads and writes outside the working directory
    (reads: also outside `read_roots`, the standard library), spawning, ctypes."""
    root = os.path.realpath(workdir)
    readable = tuple(os.path.realpath(p) for p in read_roots) + (root,)
    inet = {AF_INET, AF_INET6}
    realpath, fsdecode = os.path.realpath, os.fsdecode

    def under(path, roots) -> bool:
        if isinstance(path, int):
            return True  # an already-open descriptor was checked when it was opened
        p = fsdecode(path)
        if p in _ALLOWED_DEVICES:
            return True
        rp = realpath(p)
        return any(rp == r or rp.startswith(r.rstrip("/") + "/") for r in roots)

    def hook(event, args):
        if event in ("socket.__new__",):
            if len(args) > 1 and args[1] in inet:
                raise PermissionError("sandbox: network access is disabled")
        elif event in ("socket.connect", "socket.bind", "socket.sendto"):
            if not isinstance(args[1], (str, bytes)):  # AF_UNIX paths fail on their own
                raise PermissionError("sandbox: network access is disabled")
        elif not restrict_fs:
            return
        elif event == "open":
            path, mode, flags = args
            if path is None:
                return
            writing = (flags & _WRITE_FLAGS) if isinstance(flags, int) else (
                isinstance(mode, str) and any(c in mode for c in "wax+"))
            if writing and not under(path, (root,)):
                raise PermissionError(f"sandbox: writing outside the working directory is not allowed: {path!r}")
            if not writing and not under(path, readable):
                raise PermissionError(f"sandbox: reading outside the working directory is not allowed: {path!r}")
        elif event in _READ_EVENTS:
            if args and args[0] is not None and not under(args[0], readable):
                raise PermissionError(f"sandbox: {event} outside the working directory is not allowed: {args[0]!r}")
        elif event in _PATH_EVENTS:
            paths = args[:2] if event in ("os.rename", "os.symlink", "os.link", "shutil.move") else args[:1]
            for p in paths:
                if p is not None and not under(p, (root,)):
                    raise PermissionError(f"sandbox: {event} outside the working directory is not allowed: {p!r}")
        elif event in _SPAWN_EVENTS and not allow_spawn:
            raise PermissionError(f"sandbox: {event} is not allowed in this sandbox")

    sys.addaudithook(hook)


def _run_user_code(path: str, memory_mb: int) -> int:
    with open(path, encoding="utf-8") as f:
        source = f.read()
    sys.argv = [path]
    sys.path.insert(0, os.path.dirname(path))
    glb = {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__}
    try:
        exec(compile(source, path, "exec"), glb)
    except SystemExit as e:
        code = e.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    except MemoryError:
        print(f"MemoryError: the sandbox memory limit ({memory_mb} MiB) was exceeded", file=sys.stderr)
        return 1
    except BaseException as e:  # report like the interpreter would, minus this bootstrap's frame
        import traceback  # only now: it costs more than the rest of the bootstrap

        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        traceback.print_exception(type(e), e, tb)
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return 0


def main() -> None:
    cfg = marshal.loads(bytes.fromhex(sys.argv[1]))
    status = _Status(cfg["status_fd"])
    try:  # only the untrusted code's process (C) returns from these
        code_path = _run_namespaced(cfg, status) if cfg["mode"] == "namespaces" else _run_process_mode(cfg, status)
    except BaseException as e:
        status.send(error=f"{type(e).__name__}: {e}")
        os._exit(125)
    # Outside every handler above: the program's sys.exit, atexit and threads behave as usual.
    sys.exit(_run_user_code(code_path, cfg["limits"]["memory_mb"]))
