"""Hostile-code tests of the Python sandbox: each must end in a clear observation, host unharmed."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

from megatron_sao.envs.sandbox import SandboxLimits, SandboxPool, SandboxResult, run_python

pytestmark = pytest.mark.timeout(60)
IS_ROOT = os.geteuid() == 0


def run(code: str, **limits) -> SandboxResult:
    base = dict(wall_time_s=5.0, cpu_time_s=3, memory_mb=512)
    base.update(limits)
    return asyncio.run(run_python(code, SandboxLimits(**base)))


def live_pids_of_uid(uid: int) -> list[int]:
    """Non-zombie processes owned by ``uid`` (zombies are dead and only wait for init)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            status = (d / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
            pids.append(int(d.name))
    return pids


def sandbox_uid(res: SandboxResult) -> int:
    return int(next(x for x in res.isolation if x.startswith("uid="))[4:])


def test_passing_program():
    res = run("import math\nprint('hello', math.factorial(5))")
    assert res.ok and res.exit_code == 0
    assert res.stdout == "hello 120\n"
    assert res.as_observation() == "hello 120"


def test_failing_program_reports_traceback_and_status():
    res = run("x = 1\nprint('before')\nprint(x / 0)")
    assert not res.ok and res.exit_code == 1
    obs = res.as_observation()
    assert obs.startswith("before\n[stderr]\nTraceback")
    assert "ZeroDivisionError: division by zero" in obs
    assert obs.endswith("[exit status 1]")


def test_sys_exit_code_is_propagated():
    assert run("import sys; sys.exit(3)").exit_code == 3


def test_infinite_cpu_loop_hits_cpu_limit():
    res = run("while True:\n    pass", cpu_time_s=1, wall_time_s=30)  # wall: room for a busy host
    assert not res.ok and not res.timed_out
    assert "CPU time limit of 1 s exceeded" in res.as_observation()


def test_sleeping_loop_hits_wall_clock():
    res = run("import time\nwhile True:\n    time.sleep(0.05)", wall_time_s=1.0)
    assert res.timed_out
    assert "[killed: wall-clock limit of 1 s exceeded]" in res.as_observation()


def test_huge_allocation_fails_cleanly():
    res = run("x = bytearray(4 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert "allocated" not in res.stdout
    assert "MemoryError" in res.as_observation() and "256 MiB" in res.stderr


def test_output_flood_is_truncated_and_killed():
    res = run("while True:\n    print('x' * 1000)", max_output_bytes=2000)
    assert res.stdout_truncated and len(res.stdout) <= 2000
    assert "output limit of 2000 bytes exceeded" in res.as_observation()


def test_file_size_limit():
    res = run("open('big.bin', 'wb').write(b'0' * (3 << 20))", max_file_mb=1)
    assert res.exit_code == 1 and "File too large" in res.stderr


def test_write_outside_workdir_is_denied_and_host_untouched():
    target = Path(f"/tmp/evil_x_{uuid.uuid4().hex}")
    res = run(f"open({str(target)!r}, 'w').write('pwned')")
    assert "writing outside the working directory is not allowed" in res.as_observation()
    assert not target.exists()


@pytest.mark.skipif(not IS_ROOT, reason="as non-root, spawning is denied outright (see next test)")
def test_shell_write_to_tmp_lands_in_private_tmpfs():
    target = Path(f"/tmp/evil_sh_{uuid.uuid4().hex}")
    res = run(f"import os\nos.system('echo pwned > {target}')\nprint(open({str(target)!r}).read(), end='')")
    assert res.stdout == "pwned\n"  # the write happened, but only inside the sandbox's /tmp
    assert "mountns" in res.isolation
    assert not target.exists()


def test_workdir_is_private_and_removed():
    res = run("import os\nopen('scratch.txt', 'w').write('ok')\nprint(os.getcwd())\n"
              "print(oct(os.stat('.').st_mode & 0o777))")
    cwd, mode = res.stdout.split()
    assert mode == "0o700"
    assert not Path(cwd).exists()


def test_trainer_environment_is_invisible(monkeypatch):
    monkeypatch.setenv("SAO_TEST_SECRET", "hunter2-top-secret")
    res = run("import os\nprint(sorted(os.environ))\nprint(open('/proc/self/environ').read())")
    assert "hunter2" not in res.stdout
    assert res.stdout.splitlines()[0] == "['HOME', 'LANG', 'PATH']"


def test_socket_to_localhost_fails_with_clear_error():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        res = run(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
        assert "connected" not in res.stdout
        assert "network access is disabled" in res.as_observation()
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing ever reached the listener
    finally:
        server.close()


@pytest.mark.skipif(not IS_ROOT, reason="needs root to run the child under a private uid")
def test_fork_bomb_is_contained_and_cleaned_up():
    code = ("import os\nwhile True:\n    try:\n        os.fork()\n"
            "    except OSError:\n        pass\n")
    res = run(code, max_processes=8, cpu_time_s=2, wall_time_s=2.0)
    assert not res.ok and res.killed_reason is not None
    assert live_pids_of_uid(sandbox_uid(res)) == []
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


@pytest.mark.skipif(not IS_ROOT, reason="needs root to run the child under a private uid")
def test_daemon_that_escapes_the_session_is_killed():
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    os.close(1); os.close(2)\n"
            "    time.sleep(300)\nprint('parent done')")
    res = run(code, wall_time_s=5.0)
    assert res.ok and res.stdout == "parent done\n"
    assert live_pids_of_uid(sandbox_uid(res)) == []


def test_concurrency_cap_is_respected():
    pool = SandboxPool(max_concurrency=2)
    in_flight, peak = 0, 0
    original = pool._run_in

    async def counting(*args, **kwargs):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await original(*args, **kwargs)
        finally:
            in_flight -= 1

    pool._run_in = counting

    async def main():
        return await asyncio.gather(*(pool.run(f"print({i})") for i in range(6)))

    results = asyncio.run(main())
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)]
    assert peak == 2


def test_bad_limits_and_inputs_are_rejected():
    with pytest.raises(ValueError, match="cpu_time_s"):
        SandboxLimits(cpu_time_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=-1)
    with pytest.raises(TypeError, match="code must be str"):
        asyncio.run(run_python(b"print(1)"))  # type: ignore[arg-type]
