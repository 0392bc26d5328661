"""Hostile programs against the sandbox in every mode it runs in: as root and as an ordinary user,
with namespaces and without (process mode). The "trainer" is a runner process (sandbox_runner.py)
started as root or, through setpriv, as an unprivileged user; each program attacks that runner.

CI runs as root: the non-root modes drop privileges here (setpriv to nobody), so they run in CI too.
Beside them run the non-root user's own processes an attacker in same-uid process mode goes for: a
real tmux server (Debian's tmux; `make venv` installs it) at the standard socket path and a process
holding a secret in its environment. The process-mode attacks first switch the child's audit hook
off (one line of Python through gc), so what holds is what the kernel enforces.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.paths import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
NOBODY = 65534
SECRET = f"hunter2-{uuid.uuid4().hex}"
OTHER_SECRET = f"neighbour-{uuid.uuid4().hex}"
TMUX_SESSION = "sao-hostile"
STAMP = 1_000_000  # the mtime of the files the utime attack goes for
# The attack's first line: clear the audit hook's `restrict_fs` closure cell (found through gc).
UNHOOK = ("import gc; [c.__setattr__('cell_contents', False) for f in gc.get_objects() if getattr(f, '__name__', '') "
          "== 'hook' and getattr(f, '__closure__', None) for n, c in zip(f.__code__.co_freevars, f.__closure__) "
          "if n == 'restrict_fs']\nimport ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint('unhooked')\n")

# mode -> (run as root?, SandboxPool arguments)
MODES = {
    "root-namespaces": (True, {}),
    "user-namespaces": (False, {}),
    "root-process": (True, {"isolation": "process"}),
    "user-process": (False, {"isolation": "process", "allow_same_uid": True}),
}


def _neighbour_cases(outside: str, other: int, quick: dict, stamps: dict) -> list[tuple]:
    """The same-uid attacks (issue 24), each after UNHOOK; `other` is the neighbour's pid. Every mode
    runs them: in user-namespaces mode, too, the code is the neighbours' uid on the host."""
    tmux_sock = f"/tmp/tmux-{NOBODY}/default"
    try_ = ("def attempt(what, fn):\n    try:\n        r = fn()\n        print('DONE', what, r)\n"
            "    except OSError as e:\n        print('refused', what, e.errno)\n"
            "def raw(rc):\n    if rc < 0:\n        raise OSError(ctypes.get_errno(), 'raw syscall')\n    return rc\n")
    return [
        ("tmux", UNHOOK + try_ + "import socket, subprocess\n"
                 f"attempt('unix connect', lambda: socket.socket(socket.AF_UNIX).connect({tmux_sock!r}))\n"
                 "attempt('raw socket', lambda: raw(libc.socket(1, 1, 0)))\n"
                 "attempt('dgram pair', lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM))\n"
                 "a, b = socket.socketpair()\na.send(b'x')\nprint('stream pair', b.recv(1))\n"
                 f"attempt('pair reconnect', lambda: a.connect({tmux_sock!r}))\n"
                 "attempt('tmux window', lambda: subprocess.run(['tmux', 'new-window', "
                 f"'touch {outside}']).returncode)\n",
         quick),
        ("exec", UNHOOK + "import os, subprocess\npid = os.fork()\nif pid == 0:\n    try:\n"
                 "        os.execv('/bin/true', ['true'])\n    except OSError as e:\n        os._exit(e.errno)\n"
                 "print('child exit', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
                 "try:\n    subprocess.run(['/bin/true'])\n    print('DONE spawn')\n"
                 "except OSError as e:\n    print('refused spawn', e.errno)\n", quick),
        ("limits", UNHOOK + try_ + "import os, resource, struct\n"
                   "idle = ctypes.create_string_buffer(struct.pack('=IIQiIQQQ', 48, 5, 0, 0, 0, 0, 0, 0))\n"
                   f"for pid in ({{PARENT}}, {other}):\n"
                   "    attempt(f'prlimit nofile {pid}', lambda: resource.prlimit(pid, resource.RLIMIT_NOFILE, (3, 3)))"
                   "\n"
                   "    attempt(f'prlimit read {pid}', lambda: resource.prlimit(pid, resource.RLIMIT_NOFILE))\n"
                   "    attempt(f'renice {pid}', lambda: os.setpriority(os.PRIO_PROCESS, pid, 19))\n"
                   "    attempt(f'affinity {pid}', lambda: os.sched_setaffinity(pid, {0}))\n"
                   "    attempt(f'scheduler {pid}', lambda: os.sched_setscheduler(pid, os.SCHED_IDLE, "
                   "os.sched_param(0)))\n"
                   "    for name, nr, args in (('ioprio', 251, (1, pid, 3 << 13)),"
                   " ('sched_setattr', 314, (pid, idle, 0)), ('migrate_pages', 256, (pid, 8, 0, 0)),"
                   " ('move_pages', 279, (pid, 0, 0, 0, 0, 0))):\n"
                   "        rc = libc.syscall(nr, *args)\n"
                   "        print('DONE' if rc == 0 else 'refused', name, pid, ctypes.get_errno())\n"
                   "attempt('renice uid', lambda: os.setpriority(os.PRIO_USER, 0, 19))\n"
                   "attempt('renice group', lambda: os.setpriority(os.PRIO_PGRP, 0, 19))\n"
                   "resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))\n"
                   # 5, or the nice it inherited when higher: an unprivileged process may not lower it
                   "os.setpriority(os.PRIO_PROCESS, 0, max(5, os.getpriority(os.PRIO_PROCESS, 0)))\n"
                   "os.sched_setaffinity(0, os.sched_getaffinity(0))\n"
                   "print('self ok', resource.getrlimit(resource.RLIMIT_NOFILE), os.getpriority(os.PRIO_PROCESS, 0))\n",
         quick),
        ("neighbour", UNHOOK + try_ + "import fcntl, os, socket\n"
                      f"attempt('environ', lambda: open('/proc/{other}/environ', 'rb').read())\n"
                      f"attempt('mem', lambda: open('/proc/{other}/mem', 'rb'))\n"
                      "a, b = socket.socketpair()\n"
                      "attempt('setown', lambda: fcntl.fcntl(a, fcntl.F_SETOWN, {PARENT}))\n"
                      "attempt('sysv shm', lambda: raw(libc.shmget(0, 4096, 0o1000 | 0o600)))\n"
                      f"attempt('chmod outside', lambda: os.chmod({os.path.dirname(tmux_sock)!r}, 0o777))\n", quick),
        # Issue 39: AF_VSOCK is outside the network namespace; timestamps by path are outside Landlock.
        ("families", UNHOOK + try_ + "import socket\n"
                     "attempt('vsock', lambda: socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).close())\n"
                     "attempt('packet', lambda: socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM).close())\n"
                     "attempt('raw vsock', lambda: raw(libc.socket(40, 1, 0)))\n", quick),
        ("utime", UNHOOK + try_ + "import os\n"
                  f"attempt('utime world-writable', lambda: os.utime({str(stamps.get('world_writable'))!r}))\n"
                  f"attempt('utime nobodys', lambda: os.utime({str(stamps.get('nobodys'))!r}, (5, 5)))\n"
                  "f = os.open('mine', os.O_WRONLY | os.O_CREAT, 0o600)\n"
                  "attempt('futimens own', lambda: os.utime(f, (5, 5)))\n", quick),
        ("hide_bytes", UNHOOK + try_ + "import os\nf = open('a', 'wb')\nf.write(b'x' * (1 << 20))\nf.flush()\n"
                       "attempt('unlink open file', lambda: os.remove('a'))\n"
                       "attempt('rename', lambda: os.rename('a', 'b'))\n"
                       "attempt('O_TMPFILE', lambda: os.open('.', os.O_TMPFILE | os.O_WRONLY, 0o600))\n"
                       "attempt('memfd', lambda: os.memfd_create('x'))\n"
                       "os.mkdir('d')\nos.rmdir('d')\nprint('dir ok')\n", quick),
    ]


def _shell_cases(secret_file: str, outside: str, port: int, quick: dict) -> list[tuple]:
    """An agent harness's bash commands, one after another in one sandbox workspace (issue 37: mini-swe-agent
    runs its commands so); each prints `rc=<status>` of its attack. The escapee names itself after the
    runner's TMPDIR so the survivors check sees it."""
    sh = {**quick, "shell": True}
    tmux_sock = f"/tmp/tmux-{NOBODY}/default"
    return [
        ("sh_read", f"cat {secret_file}; echo rc=$?; cat /proc/{{PARENT}}/environ; echo rc=$?", sh),
        ("sh_write", f"echo pwned > {outside}; echo rc=$?; touch /usr/pwned; echo rc=$?", sh),
        ("sh_network", f"(exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null; echo rc=$?", sh),
        ("sh_kill", "kill -9 {PARENT}; echo rc=$?; kill -9 -1 2>/dev/null; echo done", sh),
        ("sh_escapee", "(exec -a {TMP}/escapee sleep 300 &); (setsid sleep 300 &) 2>/dev/null; echo started", sh),
        ("sh_tmux", f"tmux -S {tmux_sock} new-window 'touch {outside}' 2>/dev/null; echo rc=$?", sh),
        ("sh_plant", f"mkfifo fifo; ln -s {secret_file} leak; ln -s / root; cat root{secret_file} 2>/dev/null; "
                     "echo rc=$?; ls", sh),
    ]


def _cases(secret_file: str, outside: str, port: int, mode: str, other: int = 0,
           stamps: dict | None = None) -> list[dict]:
    quick = {"wall_time_s": 20.0, "cpu_time_s": 5, "memory_mb": 256}
    cases = [
        ("environ", "import os\nfor p in ('/proc/{PARENT}/environ', '/proc/self/environ'):\n"
                    "    try:\n        print(open(p, 'rb').read())\n"
                    "    except OSError as e:\n        print('denied', p, type(e).__name__)\n", quick),
        ("kill_parent", "import os, signal\nfor pid in ({PARENT}, -{PARENT}, -1):\n    try:\n"
                        "        os.kill(pid, signal.SIGKILL)\n        print('sent', pid)\n"
                        "    except OSError as e:\n        print('refused', pid, type(e).__name__)\n", quick),
        # A detached child that keeps stdout/stderr open: the call must return when main ends.
        ("escapee", "import os, time\nif os.fork() == 0:\n    try:\n        os.setsid()\n    except OSError:\n"
                    "        pass\n    time.sleep(300)\n    os._exit(0)\nprint('parent done', flush=True)\n", quick),
        ("fork_bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
         {"max_processes": 8, "cpu_time_s": 2, "wall_time_s": 4.0, "memory_mb": 256}),
        ("read_host_file", f"print(open({secret_file!r}).read())\n", quick),
        ("write_outside", f"open({outside!r}, 'w').write('pwned')\nprint('wrote')\n", quick),
        ("network", f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                    "print('connected')\n", quick),
        ("passing", "import math\nprint(math.factorial(5))\n", quick),
    ]
    # Disk: 2 GiB asked for under a 32 MiB bound (namespaces: the tmpfs says ENOSPC; process mode:
    # the parent's watch kills the call). The program prints what it has written so far.
    cases.append(("disk", (UNHOOK if mode.endswith("process") else "") + "import os\nn = 0\ntry:\n"
                          "    for i in range(256):\n        open(f'f{i}', 'wb').write(b'x' * (8 << 20))\n"
                          "        n += 8\n        print('wrote', n, flush=True)\n"
                          "except OSError as e:\n    print('stopped at', n, 'MiB, errno', e.errno)\n",
                  {"max_disk_mb": 32, "max_file_mb": 16, "memory_mb": 256, "wall_time_s": 60.0, "cpu_time_s": 30,
                   "max_output_bytes": 1 << 16}))
    cases.append(("inodes", (UNHOOK if mode.endswith("process") else "") + "import os\ni = 0\ntry:\n"
                            "    for i in range(2_000_000):\n        open(f'e{i}', 'w').close()\n"
                            "        if i % 100 == 0:\n            print('made', i, flush=True)\n"
                            "except OSError as e:\n    print('stopped at', i, 'errno', e.errno)\n",
                  {"max_files": 500, "memory_mb": 256, "wall_time_s": 60.0, "cpu_time_s": 30,
                   "max_output_bytes": 1 << 16}))
    # Issue 39: a tree whose paths exceed PATH_MAX (the process-mode watch walked it by path strings and
    # skipped it), then 2 GiB asked for under the same 32 MiB bound as "disk".
    cases.append(("deep_disk", (UNHOOK if mode.endswith("process") else "") + "import os\nn = 0\ntry:\n"
                               "    for i in range(20):\n        os.mkdir('x' * 250)\n        os.chdir('x' * 250)\n"
                               "    print('deep', flush=True)\n"
                               "    for i in range(256):\n        open(f'f{i}', 'wb').write(b'x' * (8 << 20))\n"
                               "        n += 8\n        print('wrote', n, flush=True)\n"
                               "except OSError as e:\n    print('stopped at', n, 'MiB, errno', e.errno)\n",
                  {"max_disk_mb": 32, "max_file_mb": 16, "memory_mb": 256, "wall_time_s": 60.0, "cpu_time_s": 30,
                   "max_output_bytes": 1 << 16}))
    # A session of its own: kill(0) reaches the code's own group, never the bootstrap's processes.
    cases.append(("kill_group", "import os, signal\nprint('before', flush=True)\nos.kill(0, signal.SIGKILL)\n", quick))
    cases += _neighbour_cases(outside, other, quick, stamps or {})
    cases += _shell_cases(secret_file, outside, port, quick)
    if mode.startswith("root"):  # the cgroup bounds the tree as a whole (root only)
        cases.append(("memory_tree", "import os, time\nkids = []\nfor i in range(4):\n    pid = os.fork()\n"
                                     "    if pid == 0:\n        b = bytearray(100 << 20)\n"
                                     "        for j in range(0, len(b), 4096):\n            b[j] = 1\n"
                                     "        time.sleep(3)\n        os._exit(0)\n    kids.append(pid)\n"
                                     "for p in kids:\n    os.waitpid(p, 0)\nprint('all allocated')\n",
                      {"memory_mb": 160, "max_processes": 8, "wall_time_s": 60.0, "cpu_time_s": 20}))
    return [{"name": n, "code": c, "limits": {k: v for k, v in lim.items() if k != "shell"},
             "shell": bool(lim.get("shell"))} for n, c, lim in cases]


def _interpreter_for(uid: int) -> str:
    """A Python the unprivileged user can execute (the venv's may live under root's 0700 home)."""
    for cand in (sys.executable, os.path.realpath(sys.executable), shutil.which("python3"), "/usr/bin/python3"):
        if cand and subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", cand,
                                    "-I", "-c",
                                    "import subprocess, sys; subprocess.run([sys.executable, '-c', ''], check=True)"],
                                   capture_output=True).returncode == 0:
            return cand
    raise AssertionError(f"no Python interpreter is executable by uid {uid}: the non-root sandbox cannot be tested")


def _processes_mentioning(marker: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if marker.encode() in (d / "cmdline").read_bytes() and b"Z" not in (d / "stat").read_bytes().split()[2]:
                    out.append(int(d.name))
            except OSError:
                pass
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Host fixtures the programs attack: a world-readable "answers" file, a listener, a copy of the
    package readable by an unprivileged user."""
    base = Path(tempfile.mkdtemp(prefix="sao-hostile-", dir="/tmp"))
    base.chmod(0o755)
    secret = base / "answers.jsonl"
    secret.write_text(SECRET)
    secret.chmod(0o644)
    stamps = {"world_writable": base / "world_writable.txt", "nobodys": base / "nobodys.txt"}
    for name, p in stamps.items():
        p.write_text(name)
        p.chmod(0o666 if name == "world_writable" else 0o600)
        if name == "nobodys" and os.geteuid() == 0:
            os.chown(p, NOBODY, NOBODY)
        os.utime(p, (STAMP, STAMP))
    pkg = base / "pkg"
    shutil.copytree(REPO / "megatron_sao", pkg / "megatron_sao", ignore=shutil.ignore_patterns("data", "__pycache__"))
    shutil.copy(Path(__file__).with_name("sandbox_runner.py"), pkg / "sandbox_runner.py")
    for p in [pkg, *pkg.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    yield {"base": base, "secret": secret, "pkg": pkg, "server": server, "stamps": stamps}
    server.close()
    shutil.rmtree(base, ignore_errors=True)


def _as_nobody(*argv: str) -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]


def _nice_and_nofile(pid: int) -> tuple[int, str]:
    nice = int((Path(f"/proc/{pid}") / "stat").read_text().rsplit(")", 1)[1].split()[16])
    nofile = next(line for line in Path(f"/proc/{pid}/limits").read_text().splitlines() if "open files" in line)
    return nice, " ".join(nofile.split())


@pytest.fixture(scope="module")
def neighbours():
    """The non-root user's own processes beside the trainer: a tmux server at /tmp/tmux-<uid>/default
    and a process with a secret in its environment. Their nice value and limits are read before and
    after every mode's run."""
    if os.geteuid() != 0:
        pytest.skip("the neighbours run as nobody: needs root to start them (CI runs as root)")
    tmux = shutil.which("tmux")
    assert tmux, "tmux is not installed: `make venv` installs it (apt-get install tmux)"
    env = {"PATH": "/usr/bin:/bin", "TERM": "xterm", "HOME": "/tmp", "LANG": "C.UTF-8", "SHELL": "/bin/sh"}
    subprocess.run(_as_nobody(tmux, "kill-server"), env=env, capture_output=True)
    subprocess.run(_as_nobody(tmux, "new-session", "-d", "-s", TMUX_SESSION, "sleep 3600"), env=env, check=True,
                   timeout=30)
    server = int(subprocess.run(_as_nobody(tmux, "display-message", "-p", "-t", TMUX_SESSION, "#{pid}"), env=env,
                                capture_output=True, text=True, check=True).stdout)
    other = subprocess.Popen(_as_nobody("sleep", "3600"), env={**env, "SAO_OTHER_SECRET": OTHER_SECRET})
    state = {p: _nice_and_nofile(p) for p in (server, other.pid)}

    def windows() -> int:
        out = subprocess.run(_as_nobody(tmux, "list-windows", "-a"), env=env, capture_output=True, text=True)
        return len(out.stdout.splitlines())

    yield {"server": server, "other": other.pid, "state": state, "windows": windows,
           "socket": f"/tmp/tmux-{NOBODY}/default"}
    other.kill()
    other.wait()
    subprocess.run(_as_nobody(tmux, "kill-server"), env=env, capture_output=True)


def run_mode(world, mode: str, cases: list[dict], pool: dict) -> dict:
    as_root, _ = MODES[mode]
    tmp = world["base"] / f"tmp-{mode}-{uuid.uuid4().hex[:6]}"
    tmp.mkdir()
    tmp.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(world["pkg"]), "TMPDIR": str(tmp),
           "SAO_TEST_SECRET": SECRET, "LANG": "C.UTF-8"}
    if as_root:
        if os.geteuid() != 0:
            pytest.skip("root modes need root (CI runs as root)")
        # Process mode runs the code under a private uid in the host's filesystem: the interpreter
        # must be one that other users can read (this machine's venv Python lives under /root).
        interp = _interpreter_for(NOBODY) if pool.get("isolation") == "process" else sys.executable
        cmd = [interp, "-B", str(world["pkg"] / "sandbox_runner.py")]
    else:
        uid = NOBODY if os.geteuid() == 0 else os.geteuid()
        if os.geteuid() == 0:
            os.chown(tmp, uid, uid)
        drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if os.geteuid() == 0 else []
        cmd = [*drop, _interpreter_for(uid) if drop else sys.executable, "-B", str(world["pkg"] / "sandbox_runner.py")]
    p = subprocess.run(cmd, input=json.dumps({"pool": pool, "cases": cases}), capture_output=True, text=True,
                       env=env, timeout=500)
    assert p.returncode == 0, f"{mode}: runner died ({p.returncode}): {p.stderr[-3000:]}"
    out = json.loads(p.stdout)
    out["survivors"] = _processes_mentioning(str(tmp))
    return out


@pytest.fixture(scope="module", params=list(MODES))
def mode_run(request, world, neighbours):
    mode = request.param
    outside = f"/tmp/evil-{uuid.uuid4().hex}"
    cases = _cases(str(world["secret"]), outside, world["server"].getsockname()[1], mode, neighbours["other"],
                   {k: str(p) for k, p in world["stamps"].items()})
    out = run_mode(world, mode, cases, MODES[mode][1])
    return mode, out, outside


def test_nothing_escapes_and_the_trainer_survives(mode_run, world):
    mode, out, outside = mode_run
    r = out["results"]
    errors = {k: v["sandbox_error"] for k, v in r.items() if "sandbox_error" in v}
    assert not errors, errors
    assert out["alive"] and out["survivors"] == [], out["survivors"]  # no process of any call is left
    iso = r["passing"]["isolation"]
    assert r["passing"]["stdout"] == "120\n", r["passing"]
    # Isolation is what the mode promises, and the result says so.
    if mode.endswith("namespaces"):
        assert {"pidns", "netns", "mountns", "rootfs=private", "seccomp"} <= set(iso), iso
        assert ("userns" in iso) == mode.startswith("user"), iso
    else:
        assert {"pgroup", "subreaper", "seccomp=process", "disk=watched:64m", "files=watched:4096"} <= set(iso), iso
        from megatron_sao.envs.sandbox_child import landlock
        assert any(x.startswith("landlock=abi") and "keep-files" in x for x in iso) == (landlock.abi() >= 1), iso
        assert ("uid=same" in iso and "parent=nondumpable" in iso) == mode.startswith("user"), iso
    assert not any(x.startswith("audit") for x in iso), iso  # a hook the code can clear is not a layer
    # 5: no same-uid access to the parent, no signals outside the call.
    assert SECRET not in r["environ"]["stdout"], r["environ"]
    assert "sent" not in r["kill_parent"]["stdout"].replace("sent -1", ""), r["kill_parent"]
    # 5 + 8: a detached child holding the pipes: the call returns at once, reports and kills it.
    esc = r["escapee"]
    assert esc["stdout"] == "parent done\n" and not esc["timed_out"] and esc["killed_reason"] is None, esc
    assert esc["leftover_processes"] == 1 and esc["elapsed_s"] < 15, esc
    assert not r["fork_bomb"]["exit_code"] == 0 and r["fork_bomb"]["killed_reason"], r["fork_bomb"]
    # kill(0): the code's own process group only; the bootstrap lives to report the signal.
    kg = r["kill_group"]
    assert kg["stdout"] == "before\n" and kg["killed_reason"] == "terminated by signal SIGKILL", kg
    # 7: host files are out of reach (the file is readable by this user outside the sandbox).
    assert SECRET not in r["read_host_file"]["stdout"], r["read_host_file"]
    assert not Path(outside).exists()
    assert "connected" not in r["network"]["stdout"]
    with pytest.raises(BlockingIOError):
        world["server"].accept()  # nothing ever reached the listener


def test_disk_and_memory_are_bounded_for_the_call_as_a_whole(mode_run):
    mode, out, _ = mode_run
    r = out["results"]
    disk, inodes = r["disk"], r["inodes"]
    written = [int(line.split()[1]) for line in disk["stdout"].splitlines() if line.startswith("wrote")]
    made = [int(line.split()[1]) for line in inodes["stdout"].splitlines() if line.startswith("made")]
    if mode.endswith("namespaces"):  # 6: a private tmpfs of max_disk_mb and max_files inodes
        assert {"disk=tmpfs:32m", "files=tmpfs:500"} <= set(disk["isolation"]) | set(inodes["isolation"])
        assert "stopped at" in disk["stdout"] and "errno 28" in disk["stdout"], disk
        assert max(written, default=0) <= 32
        assert "stopped at" in inodes["stdout"] and "errno 28" in inodes["stdout"], inodes
        assert int(inodes["stdout"].split()[-3]) <= 500, inodes["stdout"][-200:]
    else:  # the parent's watch: killed past the bound, within one watch period's writes of it
        assert disk["killed_reason"] == "disk limit of 32 MiB exceeded", disk
        # A period is 25 ms on an idle machine; under load the watch thread and the event loop run
        # late and the call writes on meanwhile (104 MiB with a training run beside the suite, load 6).
        # Still far below the 2 GiB asked for: a watch that misses the writes never kills the call.
        assert "unhooked" in disk["stdout"] and 32 - 8 <= max(written) <= 32 + 128, disk["stdout"][-300:]
        assert inodes["killed_reason"] == "file count limit of 500 exceeded", inodes
        assert max(made) <= 500 + 2000, inodes["stdout"][-300:]
    deep = r["deep_disk"]
    deep_written = [int(line.split()[1]) for line in deep["stdout"].splitlines() if line.startswith("wrote")]
    assert "deep" in deep["stdout"], deep  # the tree past PATH_MAX was made
    if mode.endswith("namespaces"):
        assert "stopped at" in deep["stdout"] and "errno 28" in deep["stdout"], deep
    else:  # walked by directory descriptors: the bytes below PATH_MAX-long paths count like any others
        assert deep["killed_reason"] == "disk limit of 32 MiB exceeded", deep
        # Killed long before the 2 GiB it asks for (a watch that cannot see the tree never kills it). The
        # overshoot is one watch period's writes, and a walk 20 levels deep makes the period longer than
        # the plain case's: a loaded machine (load 20) let it reach 160 MiB, so the bound here is loose.
        assert max(deep_written, default=0) < 512, deep["stdout"][-300:]
    print(f"{mode}: disk stopped at {max(written, default=0)} MiB (bound 32), past PATH_MAX at "
          f"{max(deep_written, default=0)} MiB, files at {max(made, default=0)} (bound 500)")
    if mode.startswith("root"):  # 6: 4 x 100 MiB under a 160 MiB cgroup: the OOM kill is reported
        mem = r["memory_tree"]
        assert any(x.startswith("memory=cgroup") for x in mem["isolation"]), mem["isolation"]
        assert "for the whole call exceeded" in (mem["killed_reason"] or ""), mem
    else:  # without a cgroup the bound is per process, and the result says so
        assert any(x.startswith("memory=per-process") for x in r["passing"]["isolation"])


def test_same_uid_without_isolation_is_refused_unless_allowed(world):
    out = run_mode(world, "user-process", [{"name": "x", "code": "print(1)", "limits": {}}], {"isolation": "process"})
    msg = out["results"]["x"].get("sandbox_error", "")
    assert "env.sandbox_allow_same_uid" in msg and "own uid" in msg, out


def _lines(res: dict) -> dict[str, str]:
    """'refused what errno' / 'DONE what result' lines of an attack: what -> outcome."""
    out = {}
    for line in res["stdout"].splitlines():
        verdict, _, rest = line.partition(" ")
        if verdict in ("refused", "DONE"):
            what, _, detail = rest.rpartition(" ")
            out[what] = f"{verdict} {detail}"
    return out


def test_same_uid_neighbours_are_out_of_reach(mode_run, neighbours, world):
    """Issue 24, each after the audit hook is off: no unix-socket connect (the tmux server), no exec,
    no prlimit/renice/affinity/ioprio of the trainer or a neighbour, no neighbour's /proc, no hidden bytes.
    Process mode refuses each in seccomp or Landlock (the errno says which); namespaces modes do not
    even see the neighbours (no such path, no such process)."""
    mode, out, outside = mode_run
    process_mode = mode.endswith("process")
    r = out["results"]
    for name in ("tmux", "exec", "limits", "neighbour", "hide_bytes", "families", "utime"):
        assert "sandbox_error" not in r[name] and "unhooked" in r[name]["stdout"], (name, r[name])
    # What nobody may do in any mode: the state of the trainer and of the neighbours is untouched.
    assert neighbours["windows"]() == 1 and not Path(outside).exists()
    assert OTHER_SECRET not in json.dumps(r) and SECRET not in json.dumps(r)
    assert out["self_before"] == out["self_after"], (out["self_before"], out["self_after"])
    for pid, before in neighbours["state"].items():
        assert _nice_and_nofile(pid) == before, pid
    assert os.stat(os.path.dirname(neighbours["socket"])).st_mode & 0o777 == 0o700
    tmux, lim, nb, hide = (_lines(r[k]) for k in ("tmux", "limits", "neighbour", "hide_bytes"))
    fam, ut = _lines(r["families"]), _lines(r["utime"])
    assert all(os.stat(p).st_mtime == STAMP for p in world["stamps"].values()), mode  # issue 39: utime by path
    assert set(fam) == {"vsock", "packet", "raw vsock"} and all(v.startswith("refused") for v in fam.values()), fam
    assert ut["futimens own"] == "DONE None", ut  # a descriptor the call opened itself
    assert len(lim) == 2 * 9 + 2, lim
    targeted = {k: v for k, v in lim.items() if k.split()[-1] in (str(out["pid"]), str(neighbours["other"]))}
    assert len(targeted) == 18 and all(v.startswith("refused") for v in targeted.values()), targeted
    assert tmux["unix connect"].startswith("refused") and tmux["tmux window"] != "DONE 0", tmux
    assert nb["environ"].startswith("refused"), nb
    if not process_mode:  # another PID namespace and root filesystem: nothing to reach
        assert tmux["unix connect"] == "refused 2" and set(targeted.values()) == {"refused 3"}, (tmux, targeted)
        assert set(fam.values()) == {"refused 97"}, fam  # the namespaces filter's socket families
        assert ut["utime world-writable"] == ut["utime nobodys"] == "refused 2", ut
        assert tmux["tmux window"] == "DONE 1", tmux  # tmux runs there, and finds no server
        return
    # Process mode: seccomp (EPERM/EACCES) and Landlock (EACCES) refuse, whatever the interpreter says.
    assert tmux["unix connect"] == "refused 13" and tmux["raw socket"] == "refused 13", tmux
    assert tmux["dgram pair"] == "refused 13" and "stream pair b'x'" in r["tmux"]["stdout"], tmux
    assert tmux["pair reconnect"] == "refused 1" and tmux["tmux window"] == "refused 1", tmux
    assert "child exit 1" in r["exec"]["stdout"] and "refused spawn 1" in r["exec"]["stdout"], r["exec"]
    assert all(v == "refused 1" for v in lim.values()), lim  # own uid and group included
    nice = max(5, os.getpriority(os.PRIO_PROCESS, 0))  # the call inherits this process's nice
    assert f"self ok (32, 32) {nice}" in r["limits"]["stdout"], r["limits"]  # the call itself still may
    assert nb["environ"] == "refused 13" and nb["mem"] == "refused 13", nb
    assert nb["setown"] == "refused 1" and nb["sysv shm"] == "refused 1", nb
    assert nb["chmod outside"] == "refused 1", nb
    assert hide["unlink open file"] == "refused 13" and hide["rename"] == "refused 13", hide
    assert hide["O_TMPFILE"] == "refused 1" and hide["memfd"] == "refused 1", hide
    assert set(fam.values()) == {"refused 13"}, fam  # no socket() at all
    assert ut["utime world-writable"] == ut["utime nobodys"] == "refused 1", ut
    assert "dir ok" in r["hide_bytes"]["stdout"]


def test_an_agent_s_shell_commands_in_a_workspace_stay_inside(mode_run, world, neighbours):
    """Issue 37: the bash commands of an agent harness, run one after another in one workspace (programs
    allowed), reach no host file, network, trainer, neighbour or tmux server; a background process dies
    with its command; what they plant (a FIFO, symlinks to the host) is copied back as links, not
    followed; the workspace is gone after close."""
    mode, out, outside = mode_run
    r = out["results"]
    for name in ("sh_read", "sh_write", "sh_network", "sh_kill", "sh_escapee", "sh_tmux", "sh_plant"):
        assert "sandbox_error" not in r[name], (name, r[name])
    assert "workspace" in r["sh_read"]["isolation"], r["sh_read"]["isolation"]
    if mode.endswith("process"):
        assert any(x.startswith("seccomp=process+exec") for x in r["sh_read"]["isolation"])
    assert SECRET not in r["sh_read"]["stdout"] and "rc=0" not in r["sh_read"]["stdout"], r["sh_read"]
    assert not Path(outside).exists(), r["sh_write"]  # namespaces: the call's own /tmp took it; process: refused
    assert r["sh_write"]["stdout"].rstrip().endswith("rc=1"), r["sh_write"]  # /usr is read-only in every mode
    if mode.endswith("process"):
        assert "Permission denied\nrc=1\ntouch" in r["sh_write"]["stdout"], r["sh_write"]  # Landlock
    assert r["sh_network"]["stdout"].strip() != "rc=0", r["sh_network"]
    with pytest.raises(BlockingIOError):
        world["server"].accept()
    assert out["alive"] and "rc=0" not in r["sh_kill"]["stdout"], r["sh_kill"]
    assert r["sh_escapee"]["stdout"] == "started\n" and r["sh_escapee"]["elapsed_s"] < 15, r["sh_escapee"]
    assert out["survivors"] == []  # the background sleeps died with their command
    assert r["sh_tmux"]["stdout"].strip() != "rc=0" and neighbours["windows"]() == 1, r["sh_tmux"]
    assert SECRET not in r["sh_plant"]["stdout"] and "rc=0" not in r["sh_plant"]["stdout"], r["sh_plant"]
    assert out["fork"]["leak"] == {"link": True, "exists": True}, out["fork"]  # copied as a link, not read
    assert out["fork"]["fifo"] == {"link": False, "exists": False}, out["fork"]  # skipped: it would block
    assert out["workspace_removed"]
