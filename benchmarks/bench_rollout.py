"""Rollout throughput and weight-sync speed of each rollout backend.

For each backend and model it runs ``--requests`` concurrent single rollouts of ``--new-tokens`` tokens
(T=1, no EOS stop is forced, so lengths vary), ``--repeats`` times after one warm-up round, and times
``--syncs`` full weight pushes through ``WeightSync``. Prints one line per measurement and a JSON summary.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_rollout.py                      # tiny dense+MoE, hf+vllm
    .venv/bin/python benchmarks/bench_rollout.py --model-dir /path/to/hf --backends vllm

Without ``--model-dir`` it builds the tiny random Qwen3 / Qwen3-MoE test models in a temp dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "rollout"))  # engine_fixtures: the tiny test models

from megatron_sao.rollout.engines.factory import make_engine  # noqa: E402
from megatron_sao.rollout.engines.protocol import EngineConfig, SamplingParams  # noqa: E402
from megatron_sao.weights.sync import WeightSync  # noqa: E402


async def bench_one(backend: str, model_dir: str, args: argparse.Namespace) -> dict:
    from engine_fixtures import load_checkpoint, perturbed

    t0 = time.perf_counter()
    cfg = EngineConfig(backend=backend, model_path=model_dir, max_model_len=512, max_batch_size=args.requests,
                       kv_cache_memory_bytes=64 << 20)
    engine = make_engine(cfg)
    startup = time.perf_counter() - t0
    sampling = [SamplingParams(max_new_tokens=args.new_tokens, seed=i) for i in range(args.requests)]
    prompts = [[5 + (i % 50), 6, 7, 8] for i in range(args.requests)]

    async def round_() -> tuple[float, int]:
        t = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, sampling)))
        return time.perf_counter() - t, sum(len(o.token_ids) for o in outs)

    await round_()  # warm-up (first-request compilation / allocation)
    rounds = [await round_() for _ in range(args.repeats)]
    secs = statistics.median(r[0] for r in rounds)
    tokens = statistics.median(r[1] for r in rounds)

    state = load_checkpoint(model_dir)
    sync = WeightSync([engine], timeout_s=300)
    pushes = []
    for v in range(1, args.syncs + 1):
        new = perturbed(state, seed=v)
        names = list(new)
        buckets = [[(n, new[n]) for n in names[i : i + 16]] for i in range(0, len(names), 16)]
        pushes.append(await sync.push(buckets, version=v))
    await engine.close()
    push_s = statistics.median(m.seconds for m in pushes)
    return {
        "backend": backend, "model": Path(model_dir).name, "startup_s": round(startup, 2),
        "requests": args.requests, "median_round_s": round(secs, 3), "tokens_per_round": tokens,
        "tokens_per_s": round(tokens / secs, 1), "trajectories_per_s": round(args.requests / secs, 2),
        "sync_bytes": pushes[0].bytes, "sync_median_s": round(push_s, 4),
        "sync_bytes_per_s": round(pushes[0].bytes / push_s),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", action="append", help="HF model dir (repeatable); default: tiny dense + MoE")
    p.add_argument("--backends", default="hf,vllm", help="comma list of hf,vllm")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--syncs", type=int, default=3)
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = args.model_dir
        if not dirs:
            from engine_fixtures import make_tiny_model

            dirs = [str(make_tiny_model(tmp, k)) for k in ("dense", "moe")]
        for backend in args.backends.split(","):
            for d in dirs:
                r = asyncio.run(bench_one(backend.strip(), d, args))
                print(f"{r['backend']:5s} {r['model']:6s}: {r['tokens_per_s']:8.1f} tok/s, "
                      f"{r['trajectories_per_s']:6.2f} traj/s ({r['requests']} x <= {args.new_tokens} tok); "
                      f"sync {r['sync_bytes'] / 1e6:.2f} MB in {r['sync_median_s'] * 1e3:.1f} ms "
                      f"({r['sync_bytes_per_s'] / 1e6:.1f} MB/s); startup {r['startup_s']} s", flush=True)
                results.append(r)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
