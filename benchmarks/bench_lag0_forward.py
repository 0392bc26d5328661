"""Trainer step time with and without the extra actor forward that only measured the lag-0 mismatch.

Command (the figure in the report):
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_lag0_forward.py --batch 64 --seq 160 --steps 5

The demo's model shape (tiny_qwen3_moe: 4 layers, 4 experts top-2, random init) and batch shape
(64 trajectories of up to 160 tokens: prompt, then alternating actions and observations). One SAO
trainer step's model work as `trainer/step.py::sao_step` does it: critic values, K=2 critic train steps, then
the actor section, either
  before: `actor.logprobs(batch)` (only for the lag-0 mismatch metric) + the DIS train step, or
  after:  the DIS train step, whose loss reports the mismatch from its own log-probs (lag0_mask).
The two variants alternate step by step on the same engines (so machine noise hits both alike);
the report is the median of each and their ratio. Rollouts, targets and weight sync are the same
in both and left out, so the fraction saved of a real step is at most the one printed here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))


def make_batch(b: int, t: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
    lengths[0] = t
    attn = torch.arange(t)[None] < lengths[:, None]
    # prompt (first quarter), then actions and observations in blocks of 12 tokens
    block = (torch.arange(t) - t // 4) // 12
    action = attn & (torch.arange(t)[None] >= t // 4) & (block[None] % 2 == 0)
    return dict(tokens=torch.randint(0, vocab, (b, t), generator=g), attention_mask=attn, action_mask=action,
                advantages=torch.randn(b, t, generator=g) * action, returns=torch.randn(b, t, generator=g) * action,
                versions=torch.where(action, 0, -1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=160)
    ap.add_argument("--micro-batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant (after one warm-up each)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    from megatron_sao.megatron.cpu_compat import ensure_cpu_compat

    ensure_cpu_compat()
    from megatron_sao.config import PAPER_CRITIC_FREEZE, AlgorithmConfig
    from megatron_sao.megatron.engine import InitSource, MegatronEngine
    from megatron_sao.megatron.optimizer import OptimConfig
    from megatron_sao.models.builtin import BUILTIN_MODELS
    from megatron_sao.models.freeze import expand_freeze_entries
    from megatron_sao.models.hf_config import model_spec_from_hf
    from megatron_sao.models.parallel_sizes import ParallelSizes
    from megatron_sao.models.presets import tiny_hf_config
    from megatron_sao.trainer.losses import critic_loss_fn, lag0_mismatch, policy_loss_fn

    shape = dict(BUILTIN_MODELS["tiny_qwen3_moe"])
    spec = model_spec_from_hf(tiny_hf_config(shape.pop("arch"), vocab_size=128, **shape))
    common = dict(micro_batch_size=args.micro_batch_size)
    actor = MegatronEngine(spec, ParallelSizes(), OptimConfig(lr=1e-6), role="actor", init=InitSource.random(0),
                           **common)
    critic = MegatronEngine(spec, ParallelSizes(), OptimConfig(lr=5e-6), role="critic", init=InitSource.random(0),
                            freeze_patterns=expand_freeze_entries(PAPER_CRITIC_FREEZE, spec), ctx=actor.ctx, **common)
    batch = make_batch(args.batch, args.seq, spec.vocab_size)
    batch["rollout_logprobs"] = actor.logprobs(batch) * batch["action_mask"]  # lag 0: sampled by these weights
    policy_loss, value_loss = policy_loss_fn(AlgorithmConfig()), critic_loss_fn()

    def step(extra_forward: bool) -> tuple[float, float]:
        fields = dict(batch)
        t0 = time.perf_counter()
        critic.values(fields)
        for _ in range(2):
            critic.train_step(fields, value_loss)
        forward_s = 0.0
        if extra_forward:  # the removed code path
            tf = time.perf_counter()
            actor.logprobs(fields)
            forward_s = time.perf_counter() - tf
        else:
            fields["lag0_mask"] = batch["action_mask"] & (batch["versions"] == 0)
        res = actor.train_step(fields, policy_loss)
        if not extra_forward:
            assert lag0_mismatch(res.metrics) is not None
        return time.perf_counter() - t0, forward_s

    step(True), step(False)  # warm-up
    before, after, forwards = [], [], []
    for _ in range(args.steps):
        s, f = step(True)
        before.append(s)
        forwards.append(f)
        after.append(step(False)[0])
    b, a = statistics.median(before), statistics.median(after)
    print(f"model: tiny_qwen3_moe ({sum(p.numel() for p in actor.module.parameters()):,} params), batch "
          f"{args.batch}x{args.seq}, micro-batch {args.micro_batch_size}, threads {torch.get_num_threads()}, "
          f"{args.steps} steps per variant, alternating")
    print(f"step with the extra actor forward:    median {b:.3f} s (min {min(before):.3f}, max {max(before):.3f}); "
          f"the forward alone median {statistics.median(forwards):.3f} s")
    print(f"step without it (mismatch from loss): median {a:.3f} s (min {min(after):.3f}, max {max(after):.3f})")
    print(f"after / before: {a / b:.3f}  ({(1 - a / b) * 100:.1f}% of the step saved)")


if __name__ == "__main__":
    main()
