"""Model FLOPs utilisation (MFU) of a Qwen3-MoE actor train step through MegatronEngine.

GPU (the figure that matters; scaled Qwen3-30B-A3B layer shapes, fewer layers, bf16):
    .venv/bin/python benchmarks/bench_mfu.py --layers 4 --seq 4096 --batch 4 --peak-tflops 989
CPU smoke run (what the test runs):
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_mfu.py --tiny

FLOPs per token (training = forward + backward = 3x forward, each multiply-add = 2 FLOPs):
    6 * N_active  +  12 * L * S * n_heads * head_dim
N_active counts the weights one token multiplies: attention (qkv, proj), the router, top-k of the
experts (k * 3 * H * I_moe per layer), and the LM head (H * V); embedding lookups and norms are
free. The second term is QK^T and AV over the full S x S score matrix (no causal halving, the
PaLM convention), so MFU is comparable with Megatron/PaLM-style reports.
MFU = tokens * FLOPs_per_token / step_time / (peak_tflops * 1e12).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))


def active_params(spec) -> int:
    """Weights one token multiplies in a forward pass (see module docstring)."""
    h = spec.hidden_size
    q = spec.num_attention_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    attn = h * (q + 2 * kv) + q * h
    if spec.is_moe:
        mlp = h * spec.num_experts + spec.moe_topk * 3 * h * spec.moe_ffn_hidden_size
    else:
        mlp = 3 * h * spec.ffn_hidden_size
    return spec.num_layers * (attn + mlp) + h * spec.vocab_size


def flops_per_token(spec, seq: int) -> float:
    return 6.0 * active_params(spec) + 12.0 * spec.num_layers * seq * spec.num_attention_heads * spec.head_dim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny CPU model (for tests); fp32")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the scaled Qwen3-30B-A3B")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="peak of the device (H100/H200 bf16 dense: 989)")
    args = ap.parse_args()

    from megatron_sao.megatron.cpu_compat import ensure_cpu_compat

    on_cpu = ensure_cpu_compat()
    if on_cpu:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from megatron_sao.megatron.engine import InitSource, MegatronEngine
    from megatron_sao.megatron.optimizer import OptimConfig
    from megatron_sao.models.hf_config import load_hf_config, model_spec_from_hf
    from megatron_sao.models.parallel_sizes import ParallelSizes
    from megatron_sao.models.presets import qwen3_30b_a3b_config, tiny_hf_config

    if args.tiny:
        cfg, dtype = tiny_hf_config("qwen3_moe"), torch.float32
        args.seq, args.batch, args.micro_batch_size = min(args.seq, 64), min(args.batch, 2), 1
    else:
        fields = qwen3_30b_a3b_config().to_dict()
        fields.update(num_hidden_layers=args.layers, max_position_embeddings=max(args.seq, 4096))
        cfg, dtype = load_hf_config(fields), torch.bfloat16
    spec = model_spec_from_hf(cfg)
    engine = MegatronEngine(spec, ParallelSizes(), OptimConfig(lr=1e-6), role="actor", init=InitSource.random(0),
                            micro_batch_size=args.micro_batch_size, params_dtype=dtype)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (args.batch, args.seq), generator=g)
    ones = torch.ones(args.batch, args.seq, dtype=torch.bool)
    batch = dict(tokens=tokens, attention_mask=ones, action_mask=ones)

    def loss_fn(logprobs, mb, denom):
        return -(logprobs * mb["action_mask"]).sum() / denom, {}

    def step() -> float:
        if not on_cpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.train_step(batch, loss_fn)
        if not on_cpu:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    step()  # warm-up
    dt = statistics.median(step() for _ in range(args.steps))
    tokens_per_step = args.batch * args.seq
    fpt = flops_per_token(spec, args.seq)
    achieved = tokens_per_step * fpt / dt / 1e12
    print(f"model: {'tiny' if args.tiny else 'scaled Qwen3-30B-A3B'} qwen3_moe, {spec.num_layers} layers, "
          f"{spec.num_experts} experts top-{spec.moe_topk}, active params {active_params(spec):,}, {dtype}")
    print(f"batch {args.batch}x{args.seq}, step {dt * 1000:.1f} ms (median of {args.steps}), "
          f"{tokens_per_step / dt:,.0f} tokens/s, {fpt:.4g} FLOP/token")
    print(f"achieved {achieved:.4g} TFLOP/s; "
          f"MFU {100 * achieved / args.peak_tflops:.4g}% of {args.peak_tflops:g} TFLOP/s peak")


if __name__ == "__main__":
    main()
