"""DP balance and padding of the batch plan (megatron/batching.py), the rule it replaced against the
balanced one, and one real 2-rank train step of each, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_batching.py [--draws 200] [--reps 3] [--json]

1. Plan figures on the AIME recipe's shape (examples/qwen3_30b_a3b/aime_disaggregated.yaml): batch 128,
   DP 8, TP 4 with sequence parallel (widths a multiple of 4), lengths lognormal (median 15.5K,
   sigma 0.95) clipped to 2K-128K (mean ~24K), `--draws` batches. Cost of a row: tokens + attention
   (megatron/compute_cost.py with Qwen3-30B-A3B's shape: a = 6.5e-5 per token^2). Per batch:
   compute_ratio = the busiest rank's padded cost / (total real cost / 8); padding_fraction = padded
   tokens that are not real / all computed tokens. "old": `plan_contiguous`, sorted rows in contiguous
   blocks, micro-batch i padded to the widest i-th micro-batch of all ranks, micro_batch_size 1 (the
   recipe's); "new": `plan_balanced`, the recipe's micro_batch_size 64 and max_tokens_per_micro_batch
   131072 under the GPU path's rule (alltoall dispatcher: equal forward counts, own widths);
   "new_allgather" the same under the CPU build's rule (one shape per micro-batch index on all ranks).
   Mean and 95th percentile over the draws.
2. One real step on 2 gloo ranks (tiny Qwen3-MoE, EP 2, the CPU build's allgather dispatcher and the
   GPU path's alltoall): critic values, one critic and one actor train step on a long-tailed batch of
   32 rows (the same lognormal scaled to 16-512 tokens), old plan (micro_batch_size 1) and new
   (micro_batch_size 64, budget 512) interleaved `--reps` times after a warm-up; the median seconds
   of each and new/old.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

BATCH, DP, SEQ_MULTIPLE, MAX_LEN, MIN_LEN = 128, 8, 4, 131072, 2048
MEDIAN, SIGMA = 15500.0, 0.95


def aime_lengths(rng: random.Random, n: int = BATCH, scale: float = 1.0) -> list[int]:
    lo, hi = max(2, int(MIN_LEN * scale)), int(MAX_LEN * scale)
    return [min(max(int(rng.lognormvariate(math.log(MEDIAN * scale), SIGMA)), lo), hi) for _ in range(n)]


def plan_figures(draws: int) -> dict:
    from megatron_sao.megatron.batching import ShapeRule, plan_balanced, plan_contiguous, plan_stats
    from megatron_sao.megatron.compute_cost import CostModel
    from megatron_sao.models.hf_config import model_spec_from_hf
    from megatron_sao.models.presets import qwen3_30b_a3b_config

    cost = CostModel.for_model(model_spec_from_hf(qwen3_30b_a3b_config()))
    rng = random.Random(0)
    rows: dict[str, list] = {"old": [], "new": [], "new_allgather": []}
    means = []
    for _ in range(draws):
        lengths = aime_lengths(rng)
        means.append(sum(lengths) / len(lengths))
        plans = {
            "old": plan_contiguous(lengths, dp=DP, micro_batch_size=1, seq_multiple=SEQ_MULTIPLE),
            "new": plan_balanced(lengths, dp=DP, micro_batch_size=64, max_tokens=MAX_LEN, seq_multiple=SEQ_MULTIPLE,
                                 cost=cost, rule=ShapeRule(equal_count=True)),
            "new_allgather": plan_balanced(lengths, dp=DP, micro_batch_size=64, max_tokens=MAX_LEN,
                                           seq_multiple=SEQ_MULTIPLE, cost=cost,
                                           rule=ShapeRule(equal_count=True, equal_shapes=True)),
        }
        for name, p in plans.items():
            s = plan_stats(p, lengths, cost)
            rows[name].append((s.compute_ratio, s.padding_fraction, max(s.forward_calls)))

    def summary(vals: list) -> dict:
        out = {}
        for i, key in enumerate(("compute_ratio", "padding_fraction", "forward_calls")):
            xs = sorted(v[i] for v in vals)
            out[key] = round(statistics.fmean(xs), 4)
            out[f"{key}_p95"] = round(xs[int(0.95 * (len(xs) - 1))], 4)
        return out

    return {"draws": draws, "mean_length": round(statistics.fmean(means)), "attention_coeff": cost.attention_coeff,
            **{name: summary(v) for name, v in rows.items()}}


# ------------------------------------------------------------------------------------ the real step
def worker(tmp: str, reps: int, dispatchers: list[str]) -> None:
    sys.path.insert(0, os.path.join(ROOT, "tests", "megatron", "workers"))
    import torch
    import torch.distributed as dist
    from engine_common import mse_loss, nll_loss, tiny_model_dir

    from megatron_sao.megatron.engine import InitSource, MegatronEngine
    from megatron_sao.megatron.optimizer import OptimConfig
    from megatron_sao.megatron.parallel import destroy_parallel, init_parallel
    from megatron_sao.models.parallel_sizes import ParallelSizes

    dist.init_process_group("gloo")
    spec, _ = tiny_model_dir(os.path.join(tmp, "hf"))
    lengths = aime_lengths(random.Random(1), n=32, scale=512 / MAX_LEN)
    g = torch.Generator().manual_seed(0)
    cols = max(lengths)
    attn = torch.tensor([[1] * n + [0] * (cols - n) for n in lengths], dtype=torch.bool)
    action = attn.clone()
    action[:, :8] = False
    batch = dict(tokens=torch.randint(0, spec.vocab_size, (len(lengths), cols), generator=g) * attn,
                 attention_mask=attn, action_mask=action, returns=torch.randn(len(lengths), cols, generator=g))
    sizes = ParallelSizes(ep=2, etp=1)
    out = {"lengths_mean": statistics.fmean(lengths), "lengths_max": cols, "rows": len(lengths)}
    for dispatcher in dispatchers:
        ctx = init_parallel(sizes)
        engines = {}
        for name, kw in (("old", dict(assignment="contiguous", micro_batch_size=1)),
                         ("new", dict(micro_batch_size=64, max_tokens_per_micro_batch=512))):
            common = dict(init=InitSource.from_hf(os.path.join(tmp, "hf")), ctx=ctx,
                          config_overrides={"moe_token_dispatcher_type": dispatcher}, **kw)
            opt = OptimConfig(lr=1e-6)
            engines[name] = (MegatronEngine(spec, sizes, opt, role="actor", **common),
                             MegatronEngine(spec, sizes, opt, role="critic", **common))

        def step(name: str) -> float:
            actor, critic = engines[name]
            dist.barrier()
            t0 = time.perf_counter()
            critic.values(batch)
            critic.train_step(batch, mse_loss)
            actor.train_step(batch, nll_loss)
            dist.barrier()
            return time.perf_counter() - t0

        times = {"old": [], "new": []}
        for name in ("old", "new"):
            step(name)  # warm-up
        for _ in range(reps):
            for name in ("old", "new"):
                times[name].append(step(name))
        old, new = statistics.median(times["old"]), statistics.median(times["new"])
        out[dispatcher] = {"old_s": round(old, 3), "new_s": round(new, 3), "time_ratio": round(new / old, 3),
                           "old_calls": len(engines["old"][0].plan(batch).per_rank[ctx.dp_rank]),
                           "new_calls": len(engines["new"][0].plan(batch).per_rank[ctx.dp_rank])}
        engines.clear()
        destroy_parallel(destroy_process_group=False)
    if dist.get_rank() == 0:
        print("BENCH_STEP " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def real_step(reps: int) -> dict:
    import tempfile

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from launch import torchrun_cmd

    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        cmd = torchrun_cmd(2, os.path.abspath(__file__), "--worker", tmp, "--reps", str(reps))
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-4000:])
    line = next(x for x in proc.stdout.splitlines() if x.startswith("BENCH_STEP "))
    return json.loads(line[len("BENCH_STEP "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-step", action="store_true", help="the plan figures only")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.reps, ["allgather", "alltoall"])
    res = {"plan": plan_figures(args.draws)}
    if not args.no_step:
        res["step"] = real_step(args.reps)
    if args.json:
        print(json.dumps(res))
        return
    p = res["plan"]
    print(f"plan: batch {BATCH}, DP {DP}, {p['draws']} draws, mean length {p['mean_length']}")
    for name in ("old", "new", "new_allgather"):
        s = p[name]
        print(f"  {name:14s} compute_ratio {s['compute_ratio']:.3f} (p95 {s['compute_ratio_p95']:.3f})  "
              f"padding_fraction {s['padding_fraction']:.3f} (p95 {s['padding_fraction_p95']:.3f})  "
              f"forward calls/rank {s['forward_calls']:.1f}")
    if "step" in res:
        st = res["step"]
        print(f"step: 2 gloo ranks, EP 2, {st['rows']} rows, mean {st['lengths_mean']:.0f} / max {st['lengths_max']}")
        for d in ("allgather", "alltoall"):
            s = st[d]
            print(f"  {d:10s} old {s['old_s']:.3f} s ({s['old_calls']} calls)  new {s['new_s']:.3f} s "
                  f"({s['new_calls']} calls)  new/old {s['time_ratio']:.3f}")


if __name__ == "__main__":
    main()
