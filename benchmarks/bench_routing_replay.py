"""Rollout routing replay (R3): routing agreement, lag-0 log-prob mismatch and DIS kept fraction, replay off vs on.

Command (the figures in the README):
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_routing_replay.py --json

A setting where the engine's routes disagree with the trainer's: the demo model's shape (tiny_qwen3_moe,
4 layers, 4 experts top-2, random init with clear router margins), the rollout engine (the HF engine,
which returns its routers' choices) in bf16, the trainer (the Megatron actor) in fp32 with the same
weights. `--noise s` also perturbs the engine's router weights by N(0, s^2) (a larger drift between two
stacks; most of its mismatch then comes from the changed router probabilities, which replay keeps).
The engine samples `--prompts` single-turn trajectories; the actor scores them at lag 0
(the same policy version) twice, in one process on one batch: with the engine's routes only compared
(replay off) and replayed (replay on).

Printed per mode: moe/routing_agreement (the trainer's own top-k set equals the engine's, per routed
token x layer), moe/routing_agreement_used (the set the forward used equals the engine's), the lag-0
mismatch |log p_train - log p_rollout| over action tokens (mean, median, p99), and the fraction of action
tokens DIS keeps (1 - eps_low < ratio < 1 + eps_high, the math preset's 0.3 / 5.0). `ratio` is on / off of
the mismatch figures; what is left with replay on is bf16's (and the perturbed router probabilities') own
share. `--engine-dtype float32` is the baseline of no drift.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))


def sample(engine_model, prompts: list[list[int]], new_tokens: int, seed: int):
    """Single-turn trajectories sampled by the HF engine, with its routes."""
    from megatron_sao.rollout.engines.hf_engine import HFEngine
    from megatron_sao.rollout.engines.protocol import SamplingParams
    from megatron_sao.trajectory import TrajectoryBuilder

    async def run():
        engine = HFEngine(engine_model, max_model_len=512, max_batch_size=len(prompts), seed=seed)
        try:
            return await asyncio.gather(*[
                engine.generate(p, SamplingParams(max_new_tokens=new_tokens, seed=seed + i, return_routes=True))
                for i, p in enumerate(prompts)])
        finally:
            await engine.close()

    trajs = []
    for p, r in zip(prompts, asyncio.run(run())):
        b = TrajectoryBuilder()
        b.add_prompt(p)
        b.add_routes(0, r.routed_experts)
        b.add_action(r.token_ids, r.logprobs, 0)
        trajs.append(b.finish("terminated", reward=0.0))
    return trajs


def mismatch_stats(lp: torch.Tensor, batch, eps_low: float, eps_high: float) -> dict[str, float]:
    mask = batch.action_mask
    diff = (lp - batch.rollout_logprobs)[mask].double()
    ratio = torch.exp(diff)
    kept = ((ratio > 1 - eps_low) & (ratio < 1 + eps_high)).double().mean()
    a = diff.abs()
    return {"mismatch_mean": float(a.mean()), "mismatch_median": float(a.median()),
            "mismatch_p99": float(torch.quantile(a, 0.99)), "dis_kept_fraction": float(kept),
            "action_tokens": int(mask.sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--noise", type=float, default=0.0, help="std of the engine's router-weight perturbation")
    ap.add_argument("--engine-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    from megatron_sao.megatron.cpu_compat import ensure_cpu_compat

    ensure_cpu_compat()
    from megatron_sao.config import AlgorithmConfig
    from megatron_sao.megatron.engine import InitSource, MegatronEngine
    from megatron_sao.megatron.optimizer import OptimConfig
    from megatron_sao.models.builtin import BUILTIN_MODELS
    from megatron_sao.models.hf_config import model_spec_from_hf
    from megatron_sao.models.parallel_sizes import ParallelSizes
    from megatron_sao.models.presets import tiny_hf_config, tiny_hf_model
    from megatron_sao.trajectory import collate_padded

    shape = dict(BUILTIN_MODELS["tiny_qwen3_moe"])
    cfg = tiny_hf_config(shape.pop("arch"), vocab_size=128, **shape)
    hf = tiny_hf_model(cfg, seed=args.seed)
    engine_model = copy.deepcopy(hf)
    g = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():
        for name, p in engine_model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(args.noise * torch.randn(p.shape, generator=g))
    engine_model = engine_model.to(getattr(torch, args.engine_dtype))
    gp = torch.Generator().manual_seed(args.seed + 2)
    prompts = torch.randint(3, cfg.vocab_size, (args.prompts, args.prompt_len), generator=gp).tolist()
    trajs = sample(engine_model, prompts, args.new_tokens, args.seed)
    batch = collate_padded(trajs)

    algo = AlgorithmConfig()
    out: dict = {"setting": {"model": "tiny_qwen3_moe", "engine_dtype": args.engine_dtype, "trainer_dtype": "float32",
                             "router_noise": args.noise, "trajectories": len(trajs),
                             "eps_low": algo.eps_low, "eps_high": algo.eps_high}}
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        actor = MegatronEngine(model_spec_from_hf(cfg), ParallelSizes(), OptimConfig(lr=1e-6), role="actor",
                               init=InitSource.from_hf(d), micro_batch_size=8)
        fields = {"tokens": batch.tokens, "attention_mask": batch.attention_mask, "routes": batch.routes}
        for mode, replay in (("replay_off", False), ("replay_on", True)):
            actor.replay_routes = replay
            lp = actor.logprobs(fields)
            out[mode] = {**actor.last_routing_agreement, **mismatch_stats(lp, batch, algo.eps_low, algo.eps_high)}
    off, on = out["replay_off"], out["replay_on"]
    out["ratio_on_over_off"] = {k: on[k] / off[k] if off[k] else float("nan")
                                for k in ("mismatch_mean", "mismatch_median", "mismatch_p99")}
    if args.json:
        print(json.dumps(out))
        return
    print(f"setting: {out['setting']}")
    for mode in ("replay_off", "replay_on"):
        r = out[mode]
        print(f"{mode:>10}: agreement {r['moe/routing_agreement']:.4f} used {r['moe/routing_agreement_used']:.4f}  "
              f"mismatch mean {r['mismatch_mean']:.4f} median {r['mismatch_median']:.5f} p99 {r['mismatch_p99']:.4f}  "
              f"DIS kept {r['dis_kept_fraction']:.4f}")
    print(f"ratio on/off: {out['ratio_on_over_off']}")


if __name__ == "__main__":
    main()
