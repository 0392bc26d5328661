"""Does a sandbox call's clean-up stall the event loop the rollouts run on?
``python benchmarks/bench_sandbox_cleanup.py [--n 8] [--files 4000] [--json] [--compare OTHER_CHECKOUT]``

Per mode this host can run (as bench_sandbox.py: root with namespaces, root in process mode, nobody
with user namespaces and in process mode), ``n`` calls run 4 at a time, each writing ``--files``
files of 4 KiB and leaving a forked child behind (what the clean-up must kill and remove). Beside
them a "rollout" coroutine sleeps 5 ms in a loop and records how late each wake-up is: the largest
lateness is the longest stall of the event loop, whatever caused it. The clean-up is timed twice:
its wall time (what the loop stalled for when it ran there) and the longest step of the clean-up
coroutine on the loop (what it still costs the rollouts). A control ticker in a separate idle
process, running meanwhile, shows how late any loop wakes up on this machine anyway.
``--compare DIR`` also runs each mode against the sandbox of another checkout (e.g. one from before
the clean-up moved off the loop: it has no clean-up coroutine to time), interleaved with this one.
"""

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_sandbox import MODES, run_child  # noqa: E402

TICK_S = 0.005
# The control: the same 5 ms ticker in a process of its own, until stdin closes.
CONTROL = ("import sys, threading, time\nlate = []\nstop = threading.Event()\n"
           "threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()\n"
           "while not stop.is_set():\n    t0 = time.perf_counter()\n    time.sleep(0.005)\n"
           "    late.append(time.perf_counter() - t0 - 0.005)\n"
           "late.sort()\nprint(late[-1] * 1e3, late[int(0.99 * (len(late) - 1))] * 1e3)\n")


class _StepTimed:
    """Awaitable around a coroutine that records how long each of its steps holds the event loop."""

    def __init__(self, coro, steps: list[float]) -> None:
        self.coro, self.steps = coro, steps

    def __await__(self):
        it, value, exc = self.coro.__await__(), None, None
        while True:
            t0 = time.perf_counter()
            try:
                out = it.send(value) if exc is None else it.throw(exc)
            except StopIteration as stop:
                self.steps.append(time.perf_counter() - t0)
                return stop.value
            self.steps.append(time.perf_counter() - t0)
            try:
                value, exc = (yield out), None
            except BaseException as e:  # noqa: BLE001 (handed on to the coroutine)
                value, exc = None, e


async def measure(pool_args: dict, n: int, files: int) -> dict:
    from megatron_sao.envs import sandbox
    walls: list[float] = []
    on_loop: list[float] = []
    clean_up = getattr(sandbox, "_clean_up", None)  # None: an older checkout (--compare)
    if clean_up is not None:
        async def timed_clean_up(*a):
            t0 = time.perf_counter()
            await _StepTimed(clean_up(*a), on_loop)
            walls.append(time.perf_counter() - t0)
        sandbox._clean_up = timed_clean_up
    pool = sandbox.SandboxPool(max_concurrency=4, **pool_args)
    code = (f"import os\nfor i in range({files}):\n    with open(f'f{{i}}', 'wb') as f:\n        f.write(b'x' * 4096)\n"
            "if os.fork() == 0:\n    import time\n    time.sleep(60)\n    os._exit(0)\nprint('ok')\n")
    bounds = {"max_files": files + 100} if "max_files" in sandbox.SandboxLimits.__dataclass_fields__ else {}
    limits = sandbox.SandboxLimits(max_disk_mb=files // 64 + 64, wall_time_s=60, cpu_time_s=30, **bounds)
    first = await pool.run("print(1)")  # the namespace probe, outside the measurement
    lateness: list[float] = []
    done = asyncio.Event()

    async def rollout() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(TICK_S)
            lateness.append(time.perf_counter() - t0 - TICK_S)

    control = subprocess.Popen([sys.executable, "-c", CONTROL], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    ticker = asyncio.ensure_future(rollout())
    t0 = time.perf_counter()
    results = await asyncio.gather(*(pool.run(code, limits) for _ in range(n)))
    wall = time.perf_counter() - t0
    await asyncio.sleep(0.2)  # the shielded clean-ups finish
    done.set()
    await ticker
    control_max, control_p99 = map(float, control.communicate("")[0].split())
    bad = [r for r in results if r.stdout != "ok\n" or r.leftover_processes != 1]
    assert not bad, bad[0]
    lateness.sort()
    return {"isolation": first.isolation, "calls": n, "files_per_call": files, "wall_s": wall,
            "max_stall_ms": lateness[-1] * 1e3, "p99_stall_ms": lateness[int(0.99 * (len(lateness) - 1))] * 1e3,
            "cleanup_wall_max_ms": max(walls, default=float("nan")) * 1e3,
            "cleanup_on_loop_max_ms": max(on_loop, default=float("nan")) * 1e3,
            "median_stall_ms": statistics.median(lateness) * 1e3,
            "control_max_stall_ms": control_max, "control_p99_stall_ms": control_p99}


def run_mode(mode: str, n: int, files: int, repo: Path = REPO) -> dict:
    pool_args = MODES[mode][1]
    return run_child(mode, ["-B", __file__, "--child", json.dumps(pool_args), "--n", str(n), "--files", str(files)],
                     repo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--files", type=int, default=4000)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--compare", type=Path, default=None, help="another checkout, run interleaved with this one")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        print(json.dumps(asyncio.run(measure(json.loads(a.child), a.n, a.files))))
        return
    out = {}
    for mode in MODES:
        out[mode] = run_mode(mode, a.n, a.files)
        if a.compare is not None:
            out[f"{mode} [{a.compare.name}]"] = run_mode(mode, a.n, a.files, a.compare.resolve())
    if a.json:
        print(json.dumps(out))
        return
    print(f"{'mode':28} {'max stall ms':>12} {'p99 ms':>7} {'control max/p99 ms':>18} {'clean-up wall max ms':>20} "
          f"{'clean-up on loop max ms':>23}")
    for mode, r in out.items():
        if "skipped" in r:
            print(f"{mode:28} skipped: {r['skipped']}")
            continue
        control = f"{r['control_max_stall_ms']:.1f}/{r['control_p99_stall_ms']:.1f}"
        print(f"{mode:28} {r['max_stall_ms']:12.1f} {r['p99_stall_ms']:7.1f} {control:>18} "
              f"{r['cleanup_wall_max_ms']:20.1f} {r['cleanup_on_loop_max_ms']:23.1f}")

if __name__ == "__main__":
    main()
