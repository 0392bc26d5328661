"""Sandbox latency and throughput: ``python benchmarks/bench_sandbox.py [--n 40] [--concurrency 4]``.

Prints the median latency of sequential ``print(1)`` calls (process start + isolation setup +
cleanup) and the throughput of ``n`` calls with ``concurrency`` in flight.
"""

import argparse
import asyncio
import statistics
import time

from megatron_sao.envs.sandbox import SandboxPool


async def main(n: int, concurrency: int) -> None:
    pool = SandboxPool(max_concurrency=concurrency)
    lat = []
    for _ in range(n // 2):
        t0 = time.perf_counter()
        res = await pool.run("print(1)")
        lat.append(time.perf_counter() - t0)
        assert res.ok, res
    t0 = time.perf_counter()
    results = await asyncio.gather(*(pool.run("print(sum(range(10**5)))") for _ in range(n)))
    wall = time.perf_counter() - t0
    assert all(r.ok for r in results)
    print(f"isolation: {','.join(results[0].isolation)}")
    print(f"sequential latency: median {statistics.median(lat) * 1e3:.1f} ms over {len(lat)} calls")
    print(f"concurrent: {n} calls, concurrency {concurrency}: {n / wall:.1f} calls/s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=4)
    a = ap.parse_args()
    asyncio.run(main(a.n, a.concurrency))
