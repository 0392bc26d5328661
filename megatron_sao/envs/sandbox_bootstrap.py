"""Child-side bootstrap of the Python sandbox (runs *inside* the sandbox process).

``sandbox.py`` starts ``python -I -B [-S] -c <this file's source> <config json>`` in a fresh
session with a clean environment, inside a private temporary directory. This code is trusted: it
sets up isolation, prints one status line on stderr, and only then runs the untrusted
``main.py``. Standard library only; it must not import the package (with ``-S`` it cannot).

Order matters:
1. namespaces (need root): a new network namespace (no interfaces up, so no network at all) and
   a new mount namespace in which the world-writable directories (/tmp, /var/tmp, /dev/shm,
   /run/lock) are covered by small private tmpfs mounts, so nothing written there reaches the
   host; the working directory is bind-mounted back at its own path;
2. resource limits (lowering hard limits is always allowed and survives the uid drop);
3. drop to an unprivileged uid/gid (root only): RLIMIT_NPROC is then enforced, the 0700 working
   directory is the only place that uid owns, and it cannot signal or ptrace the trainer;
4. audit hooks (always): deny IPv4/IPv6 sockets and writes outside the working directory with a
   clear PermissionError. Without both namespaces they are the only barrier for network and
   file writes, so process spawning and ctypes (which bypass the hooks) are denied too.
   Audit hooks are a best-effort layer; the namespaces and the uid are the security boundary.
"""

import json
import os
import resource
import sys

STATUS_PREFIX = "SAO-SANDBOX-READY"
CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
_ALLOWED_WRITE_PATHS = ("/dev/null",)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_PATH_EVENTS = {"os.mkdir", "os.remove", "os.rmdir", "os.symlink", "os.link", "os.rename",
                "os.chmod", "os.chown", "os.truncate", "os.utime", "shutil.rmtree",
                "shutil.copyfile", "shutil.move"}
_SPAWN_EVENTS = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
                 "pty.spawn", "ctypes.dlopen", "ctypes.cdata", "os.forkpty"}


def _libc():
    import ctypes  # imported lazily: only the root path needs it

    return ctypes, ctypes.CDLL(None, use_errno=True)


def _enter_namespaces(workdir: str, mask_dirs: list, tmpfs_mb: int) -> list:
    """Try the network and mount namespaces; return the names of those that are active."""
    active = []
    ctypes, libc = _libc()
    if libc.unshare(CLONE_NEWNET) == 0:
        active.append("netns")
    if libc.unshare(CLONE_NEWNS) != 0:
        return active
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return active  # mounts would propagate to the host: do not touch anything
    fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
    for d in mask_dirs:
        if not os.path.isdir(d) or os.path.islink(d):
            continue
        opts = f"size={tmpfs_mb}m,mode=1777".encode()
        if libc.mount(b"tmpfs", d.encode(), b"tmpfs", 0, opts) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sandbox: cannot mount a private tmpfs on {d}")
        if workdir == d or workdir.startswith(d.rstrip("/") + "/"):
            os.makedirs(workdir, exist_ok=True)
            src = f"/proc/self/fd/{fd}".encode()
            if libc.mount(src, workdir.encode(), None, MS_BIND, None) != 0:
                raise OSError(ctypes.get_errno(), f"sandbox: cannot bind the workdir into {d}")
    os.close(fd)
    os.chdir(workdir)  # re-enter through the bind mount so getcwd() matches the path
    _expose_interpreter(libc, ctypes)
    active.append("mountns")
    return active


def _expose_interpreter(libc, ctypes) -> None:
    """Make the interpreter's install tree reachable for the unprivileged uid.

    A Python installed under a private home (e.g. pyenv in 0700 /root) cannot import its own
    standard library once we drop root. Inside the mount namespace, cover the first
    non-traversable ancestor with a tmpfs and bind only the install tree back into it; this also
    hides everything else in that directory (e.g. root's credentials) from the sandbox.
    """
    target = os.path.realpath(sys.base_prefix)
    parts = target.strip("/").split("/")
    for i in range(1, len(parts)):
        anc = "/" + "/".join(parts[:i])
        if os.stat(anc).st_mode & 0o001:
            continue
        fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
        if libc.mount(b"tmpfs", anc.encode(), b"tmpfs", 0, b"size=1m,mode=0755") != 0:
            raise OSError(ctypes.get_errno(), f"sandbox: cannot mask {anc}")
        os.makedirs(target, mode=0o755, exist_ok=True)
        if libc.mount(f"/proc/self/fd/{fd}".encode(), target.encode(), None, MS_BIND | MS_REC, None) != 0:
            raise OSError(ctypes.get_errno(), f"sandbox: cannot expose {target}")
        os.close(fd)
        return


def _set_limits(lim: dict) -> None:
    def cap(res, soft, hard=None):
        resource.setrlimit(res, (soft, soft if hard is None else hard))

    cap(resource.RLIMIT_CPU, lim["cpu_s"], lim["cpu_s"] + 1)  # SIGXCPU first, SIGKILL 1 s later
    cap(resource.RLIMIT_AS, lim["memory_mb"] << 20)
    cap(resource.RLIMIT_FSIZE, lim["fsize_mb"] << 20)
    cap(resource.RLIMIT_NOFILE, lim["nofile"])
    cap(resource.RLIMIT_NPROC, lim["nproc"])
    cap(resource.RLIMIT_CORE, 0)  # SIGXCPU would otherwise dump core into the workdir


def _drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError("sandbox: failed to drop privileges")


def _install_audit_hook(workdir: str, deny_spawn: bool) -> None:
    import socket

    root = os.path.realpath(workdir)
    inet = {socket.AF_INET, socket.AF_INET6}
    realpath, fsdecode = os.path.realpath, os.fsdecode

    def inside(path) -> bool:
        if isinstance(path, int):
            return True  # an already-open descriptor was checked when it was opened
        p = fsdecode(path)
        if p in _ALLOWED_WRITE_PATHS:
            return True
        rp = realpath(p)
        return rp == root or rp.startswith(root + "/")

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            # builtin open() and os.open() both pass the OS-level flags; a mode string is a fallback
            writing = (flags & _WRITE_FLAGS) if isinstance(flags, int) else (
                isinstance(mode, str) and any(c in mode for c in "wax+"))
            if writing and path is not None and not inside(path):
                raise PermissionError(f"sandbox: writing outside the working directory is not allowed: {path!r}")
        elif event == "socket.__new__":
            if len(args) > 1 and args[1] in inet:
                raise PermissionError("sandbox: network access is disabled")
        elif event in ("socket.connect", "socket.bind", "socket.sendto"):
            raise PermissionError("sandbox: network access is disabled")
        elif event in _PATH_EVENTS:
            paths = args[:2] if event in ("os.rename", "os.symlink", "os.link", "shutil.move") else args[:1]
            for p in paths:
                if p is not None and not inside(p):
                    raise PermissionError(f"sandbox: {event} outside the working directory is not allowed: {p!r}")
        elif deny_spawn and event in _SPAWN_EVENTS:
            raise PermissionError(f"sandbox: {event} is not allowed in this sandbox")

    sys.addaudithook(hook)


def _run_user_code(path: str, memory_mb: int) -> int:
    import traceback

    with open(path, encoding="utf-8") as f:
        source = f.read()
    sys.argv = [path]
    sys.path.insert(0, os.getcwd())
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
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        traceback.print_exception(type(e), e, tb)
        return 1
    return 0


def main() -> None:
    cfg = json.loads(sys.argv[1])
    workdir = cfg["workdir"]
    os.chdir(workdir)
    active = []
    if cfg["uid"] is not None:
        os.umask(0o022)  # mount points created in the private tmpfs must be traversable
        active += _enter_namespaces(workdir, cfg["mask_dirs"], cfg["limits"]["fsize_mb"])
    os.umask(0o077)
    _set_limits(cfg["limits"])
    import socket, traceback  # noqa: F401  (loaded while the stdlib is surely readable)
    if cfg["uid"] is not None:
        _drop_privileges(cfg["uid"], cfg["gid"])
        active.append(f"uid={cfg['uid']}")
    deny_spawn = not ("netns" in active and "mountns" in active)
    _install_audit_hook(workdir, deny_spawn)
    active.append("audit" + ("+nospawn" if deny_spawn else ""))
    sys.stderr.write(f"{STATUS_PREFIX} {','.join(active)}\n")
    sys.stderr.flush()
    rc = _run_user_code(cfg["code_file"], cfg["limits"]["memory_mb"])
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(rc)


if __name__ == "__main__":
    main()
