"""What isolation costs per sandbox call, per mode: ``python benchmarks/bench_sandbox.py [--n 30]``.

For every mode this host can run -- root with namespaces (private uid, cgroup, private root fs),
root in process mode, and (as root, through setpriv to nobody; else directly) an ordinary user with
user namespaces and in process mode -- it times ``n`` sequential ``print(1)`` calls and, in the same
process, ``n`` bare ``python -I -B -S -c 'print(1)'`` subprocesses (what any process per call costs).
It prints the median per call, the overhead over the bare process, and their ratio (compare ratios:
the machine is shared and noisy), and the throughput of ``n`` calls at ``--concurrency``.
"""

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = {"root-namespaces": (True, {}), "root-process": (True, {"isolation": "process"}),
         "user-namespaces": (False, {}), "user-process": (False, {"isolation": "process", "allow_same_uid": True})}


async def measure(pool_args: dict, n: int, concurrency: int) -> dict:
    from megatron_sao.envs.sandbox import SandboxPool

    pool = SandboxPool(max_concurrency=concurrency, **pool_args)
    first = await pool.run("print(1)")  # also the one-time namespace probe
    assert first.ok, first
    bare, sandboxed = [], []
    for _ in range(n):  # interleaved, so both see the same load
        t0 = time.perf_counter()
        p = await asyncio.create_subprocess_exec(sys.executable, "-I", "-B", "-S", "-c", "print(1)",
                                                 stdout=asyncio.subprocess.PIPE)
        await p.communicate()
        bare.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        res = await pool.run("print(1)")
        sandboxed.append(time.perf_counter() - t0)
        assert res.ok, res
    t0 = time.perf_counter()
    results = await asyncio.gather(*(pool.run("print(sum(range(10**5)))") for _ in range(n)))
    wall = time.perf_counter() - t0
    assert all(r.ok for r in results)
    return {"isolation": first.isolation, "bare_ms": statistics.median(bare) * 1e3,
            "call_ms": statistics.median(sandboxed) * 1e3, "calls_per_s": n / wall}


def _interpreter_for(uid: int) -> str | None:
    for cand in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        probe = "import subprocess, sys; subprocess.run([sys.executable, '-c', ''], check=True)"
        if cand and subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", cand, "-c",
                                    probe], capture_output=True).returncode == 0:
            return cand
    return None


def run_child(mode: str, child_args: list[str], repo: Path = REPO) -> dict:
    """Run a benchmark's ``--child`` in a fresh interpreter as the mode asks (root, or nobody through
    setpriv; an interpreter a private uid can read); its last stdout line is its JSON result."""
    as_root, pool_args = MODES[mode]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    if as_root and os.geteuid() != 0:
        return {"skipped": "needs root"}
    interp = sys.executable
    if as_root and pool_args.get("isolation") == "process" or not as_root and os.geteuid() == 0:
        interp = _interpreter_for(65534)  # a private uid / nobody must be able to read the interpreter
        if interp is None:
            return {"skipped": "no interpreter readable by other users"}
    cmd = [interp, *child_args]
    if not as_root and os.geteuid() == 0:
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200, cwd="/tmp")
    if p.returncode != 0:
        return {"skipped": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_mode(mode: str, n: int, concurrency: int) -> dict:
    pool_args = MODES[mode][1]
    return run_child(mode, ["-B", __file__, "--child", json.dumps(pool_args), "--n", str(n),
                            "--concurrency", str(concurrency)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        print(json.dumps(asyncio.run(measure(json.loads(a.child), a.n, a.concurrency))))
        return
    print(f"{'mode':16} {'bare ms':>8} {'call ms':>8} {'overhead ms':>11} {'ratio':>6} {'calls/s':>8}  isolation")
    for mode in MODES:
        r = run_mode(mode, a.n, a.concurrency)
        if "skipped" in r:
            print(f"{mode:16} skipped: {r['skipped']}")
            continue
        print(f"{mode:16} {r['bare_ms']:8.1f} {r['call_ms']:8.1f} {r['call_ms'] - r['bare_ms']:11.1f} "
              f"{r['call_ms'] / r['bare_ms']:6.2f} {r['calls_per_s']:8.1f}  {','.join(r['isolation'])}")


if __name__ == "__main__":
    main()
