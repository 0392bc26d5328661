"""Tokens/s of one actor train step (DIS loss) of a tiny Qwen3-MoE through MegatronEngine on CPU.

Command (the figure in the report):
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_actor_step.py --batch 8 --seq 128 --steps 3

Counts every token of the padded batch (prompt + actions); times train_step() end to end
(forward-backward over micro-batches, DDP reduce, optimizer) after one warm-up step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from megatron_sao.megatron.cpu_compat import ensure_cpu_compat

    ensure_cpu_compat()
    from megatron_sao.algorithms.losses import dis_policy_loss
    from megatron_sao.megatron.engine import InitSource, MegatronEngine
    from megatron_sao.megatron.optimizer import OptimConfig
    from megatron_sao.models.hf_config import model_spec_from_hf
    from megatron_sao.models.parallel_sizes import ParallelSizes
    from megatron_sao.models.presets import tiny_hf_config

    spec = model_spec_from_hf(tiny_hf_config("qwen3_moe"))
    engine = MegatronEngine(spec, ParallelSizes(), OptimConfig(lr=1e-6), role="actor", init=InitSource.random(0),
                            micro_batch_size=args.micro_batch_size)
    g = torch.Generator().manual_seed(0)
    b, t = args.batch, args.seq
    tokens = torch.randint(0, spec.vocab_size, (b, t), generator=g)
    action = torch.ones(b, t, dtype=torch.bool)
    action[:, : t // 4] = False  # a prompt, then actions
    batch = dict(tokens=tokens, attention_mask=torch.ones(b, t, dtype=torch.bool), action_mask=action,
                 rollout_logprobs=engine.logprobs(dict(tokens=tokens,
                                                       attention_mask=torch.ones(b, t, dtype=torch.bool))),
                 advantages=torch.randn(b, t, generator=g))

    def loss_fn(logprobs, mb, denom):
        return dis_policy_loss(logprobs, mb["rollout_logprobs"], mb["advantages"], mb["action_mask"], 0.3, 5.0,
                               loss_denominator=denom)

    engine.train_step(batch, loss_fn)  # warm-up
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        res = engine.train_step(batch, loss_fn)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    n_params = sum(p.numel() for p in engine.module.parameters())
    print(f"model: tiny qwen3_moe ({n_params:,} params), batch {b}x{t}, micro-batch {args.micro_batch_size}, "
          f"threads {args.threads}")
    print(f"actor train_step: median {med * 1000:.1f} ms over {args.steps} steps "
          f"(min {min(times) * 1000:.1f}, max {max(times) * 1000:.1f}); loss {res.loss:.4f} skipped={res.skipped}")
    print(f"throughput: {b * t / med:,.0f} tokens/s")


if __name__ == "__main__":
    main()
