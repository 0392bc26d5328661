"""Hostile programs against the sandbox in every mode it runs in: as root and as an ordinary user,
with namespaces and without (process mode). The "trainer" is a runner process (sandbox_runner.py)
started as root or, through setpriv, as an unprivileged user; each program attacks that runner.

CI runs as root: the non-root modes drop privileges here (setpriv to nobody), so they run in CI too.
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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
SECRET = f"hunter2-{uuid.uuid4().hex}"

# mode -> (run as root?, SandboxPool arguments)
MODES = {
    "root-namespaces": (True, {}),
    "user-namespaces": (False, {}),
    "root-process": (True, {"isolation": "process"}),
    "user-process": (False, {"isolation": "process", "allow_same_uid": True}),
}


def _cases(secret_file: str, outside: str, port: int, mode: str) -> list[dict]:
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
    if mode.endswith("namespaces"):  # process mode bounds files one by one only (isolation says so)
        cases.append(("disk", "import os\nn = 0\ntry:\n    for i in range(40):\n"
                              "        open(f'f{i}', 'wb').write(b'x' * (8 << 20))\n        n += 8\n"
                              "except OSError as e:\n    print('stopped at', n, 'MiB, errno', e.errno)\n",
                      {"max_disk_mb": 32, "max_file_mb": 16, "memory_mb": 256, "wall_time_s": 30.0}))
    if mode.startswith("root"):  # the cgroup bounds the tree as a whole (root only)
        cases.append(("memory_tree", "import os, time\nkids = []\nfor i in range(4):\n    pid = os.fork()\n"
                                     "    if pid == 0:\n        b = bytearray(100 << 20)\n"
                                     "        for j in range(0, len(b), 4096):\n            b[j] = 1\n"
                                     "        time.sleep(3)\n        os._exit(0)\n    kids.append(pid)\n"
                                     "for p in kids:\n    os.waitpid(p, 0)\nprint('all allocated')\n",
                      {"memory_mb": 160, "max_processes": 8, "wall_time_s": 60.0, "cpu_time_s": 20}))
    return [{"name": n, "code": c, "limits": lim} for n, c, lim in cases]


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
    pkg = base / "pkg"
    shutil.copytree(REPO / "megatron_sao", pkg / "megatron_sao", ignore=shutil.ignore_patterns("data", "__pycache__"))
    shutil.copy(Path(__file__).with_name("sandbox_runner.py"), pkg / "sandbox_runner.py")
    for p in [pkg, *pkg.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    yield {"base": base, "secret": secret, "pkg": pkg, "server": server}
    server.close()
    shutil.rmtree(base, ignore_errors=True)


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
def mode_run(request, world):
    mode = request.param
    outside = f"/tmp/evil-{uuid.uuid4().hex}"
    cases = _cases(str(world["secret"]), outside, world["server"].getsockname()[1], mode)
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
        assert {"pgroup", "subreaper", "seccomp", "audit=fs+net+nospawn"} <= set(iso), iso
        from megatron_sao.envs.sandbox_child import landlock
        assert any(x.startswith("landlock=abi") for x in iso) == (landlock.abi() >= 1), iso
        assert ("uid=same" in iso and "parent=nondumpable" in iso) == mode.startswith("user"), iso
    # 5: no same-uid access to the parent, no signals outside the call.
    assert SECRET not in r["environ"]["stdout"], r["environ"]
    assert "sent" not in r["kill_parent"]["stdout"].replace("sent -1", ""), r["kill_parent"]
    # 5 + 8: a detached child holding the pipes: the call returns at once, reports and kills it.
    esc = r["escapee"]
    assert esc["stdout"] == "parent done\n" and not esc["timed_out"] and esc["killed_reason"] is None, esc
    assert esc["leftover_processes"] == 1 and esc["elapsed_s"] < 15, esc
    assert not r["fork_bomb"]["exit_code"] == 0 and r["fork_bomb"]["killed_reason"], r["fork_bomb"]
    # 7: host files are out of reach (the file is readable by this user outside the sandbox).
    assert SECRET not in r["read_host_file"]["stdout"], r["read_host_file"]
    assert not Path(outside).exists()
    assert "connected" not in r["network"]["stdout"]
    with pytest.raises(BlockingIOError):
        world["server"].accept()  # nothing ever reached the listener


def test_disk_and_memory_are_bounded_for_the_call_as_a_whole(mode_run):
    mode, out, _ = mode_run
    r = out["results"]
    if mode.endswith("namespaces"):  # 6: a private tmpfs of max_disk_mb for everything it writes
        assert "disk=tmpfs:32m" in r["disk"]["isolation"]
        assert r["disk"]["stdout"].startswith("stopped at") and "errno 28" in r["disk"]["stdout"], r["disk"]
        assert int(r["disk"]["stdout"].split()[2]) <= 32
    else:
        assert any(x.startswith("disk=per-file") for x in r["passing"]["isolation"])
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
