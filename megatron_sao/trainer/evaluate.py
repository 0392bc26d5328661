"""Pass@1 evaluation at temperature 1.0 and top-p 1.0 (the paper's protocol), per-item results saved.

Used by the trainer every `run.eval_every` steps (on the live rollout servers, through the rollout
side, so evaluation episodes are spread over every server like training ones) and by `sao eval` (on
an HF model directory, e.g. `<run>/sft_model` or an exported checkpoint).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

from megatron_sao.config import SAOConfig, load_config
from megatron_sao.trainer import components as C


def eval_loop_config(cfg: SAOConfig):
    loop = C.agent_loop_config(cfg)
    sampling = dataclasses.replace(loop.sampling, temperature=1.0, top_p=1.0, top_k=0)
    return dataclasses.replace(loop, sampling=sampling)


async def eval_episodes(cfg: SAOConfig, engine, formatter, tasks) -> list:
    from megatron_sao.rollout.agent_loop import run_many

    async with C.started_endpoint(cfg, formatter) as endpoint:
        return await run_many(engine, C.env_factory(cfg), tasks, formatter, eval_loop_config(cfg), endpoint=endpoint)


def summarize(tasks, trajs, out_path: str | Path | None) -> dict[str, Any]:
    rows = [{"prompt_id": t.prompt_id, "reward": tr.reward, "status": tr.status, "correct": tr.reward > 0,
             "turns": tr.num_turns, "length": tr.length, "error": tr.error}
            for t, tr in zip(tasks, trajs)]
    acc = sum(r["correct"] for r in rows) / max(len(rows), 1)
    if out_path is not None:
        p = Path(out_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(p)
    return {"accuracy": acc, "n": len(rows), "failed": sum(r["status"] == "failed" for r in rows)}


def run_eval(cfg: SAOConfig, rollout, out_path=None) -> dict[str, Any]:
    """Evaluate on the configured eval tasks with a running ``RolloutSide`` (every live server)."""
    tasks = C.eval_tasks(cfg)
    trajs = rollout.evaluate(tasks, C.env_factory(cfg), eval_loop_config(cfg), timeout_s=cfg.run.eval_timeout_s)
    return summarize(tasks, trajs, out_path)


def evaluate_model_dir(cfg: SAOConfig, model_dir: str | Path, out_path=None) -> dict[str, Any]:
    from megatron_sao.rollout.chat import ChatFormatter

    model_dir = Path(model_dir)
    formatter = ChatFormatter(C.load_tokenizer(cfg, model_dir))

    async def go():
        engine = C.build_rollout_engine(cfg, model_dir)
        try:
            return await eval_episodes(cfg, engine, formatter, tasks)
        finally:
            await engine.close()

    tasks = C.eval_tasks(cfg)
    return summarize(tasks, asyncio.run(go()), out_path)


def main(args) -> int:
    cfg = load_config(args.config, args.overrides)
    run = Path(cfg.run.dir)
    model_dir = Path(args.checkpoint) if args.checkpoint else run / "final_model"
    if not (model_dir / "config.json").exists():
        raise SystemExit(f"sao eval: {model_dir} is not an HF model directory (pass --checkpoint DIR)")
    out = args.out or str(run / "eval" / f"{model_dir.name}.jsonl")
    res = evaluate_model_dir(cfg, model_dir, out)
    print(json.dumps({"model": str(model_dir), **res, "results": out}))
    return 0
