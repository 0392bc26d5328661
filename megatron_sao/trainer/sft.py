"""`sao sft`: supervised warm start on demonstrations, loss on action tokens only.

Demonstrations are encoded with the same ChatFormatter the agent loop uses, so the policy learns
the exact token layout it will see in RL (role markers, stop tokens, observation wrapping). The
result is an HF directory `<run>/sft_model`, the starting point of value pretraining and RL.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import torch

from megatron_sao.config import OptimSection, SAOConfig, load_config, to_dict
from megatron_sao.models.builtin import resolve_model_dir
from megatron_sao.trainer import components as C
from megatron_sao.trainer.console import Console
from megatron_sao.trainer.hf_export import export_hf_model
from megatron_sao.trainer.losses import sft_loss_fn
from megatron_sao.trainer.run_dir import jsonable
from megatron_sao.trainer.scalar_sinks import stage_sinks

logger = logging.getLogger(__name__)


def load_demonstrations(cfg: SAOConfig) -> list[list[dict]]:
    if cfg.sft.data:
        rows = []
        with open(cfg.sft.data) as f:
            for i, line in enumerate(f):
                if line.strip():
                    row = json.loads(line)
                    if "messages" not in row:
                        raise ValueError(f"{cfg.sft.data}:{i + 1}: a demonstration needs a 'messages' list")
                    rows.append(row["messages"])
        return rows
    from megatron_sao.envs.registry import make_demonstrations

    # Task settings win over environment settings where both name one (the prompts must match RL's).
    settings = {**{k: v for k, v in cfg.env.kwargs.items() if v is not None}, **cfg.env.task_kwargs}
    return make_demonstrations(cfg.env.name, cfg.sft.demonstrations, seed=cfg.run.seed,
                               error_rate=cfg.sft.error_rate, settings=settings)


def pad_examples(examples: list[tuple[list[int], list[bool]]], pad_id: int) -> dict[str, torch.Tensor]:
    T = max(len(ids) for ids, _ in examples)
    B = len(examples)
    tokens = torch.full((B, T), pad_id, dtype=torch.int64)
    attn = torch.zeros((B, T), dtype=torch.bool)
    action = torch.zeros((B, T), dtype=torch.bool)
    for i, (ids, mask) in enumerate(examples):
        tokens[i, :len(ids)] = torch.tensor(ids)
        attn[i, :len(ids)] = True
        action[i, :len(ids)] = torch.tensor(mask)
    return {"tokens": tokens, "attention_mask": attn, "action_mask": action}


def run_sft(cfg: SAOConfig) -> Path:
    from megatron_sao.rollout.chat import ChatFormatter

    ctx, run = C.start_stage(cfg)
    model_dir = resolve_model_dir(cfg.model.path, run.path, cfg.run.seed)
    formatter = ChatFormatter(C.load_tokenizer(cfg, model_dir))
    demos = load_demonstrations(cfg)
    encoded = [formatter.encode_demonstration(m) for m in demos]
    kept = [e for e in encoded if len(e[0]) <= cfg.model.max_seq_len]
    if len(kept) < len(encoded):
        logger.warning("sft: %d of %d demonstrations exceed model.max_seq_len=%d and are not used",
                       len(encoded) - len(kept), len(encoded), cfg.model.max_seq_len)
    if not kept:
        raise ValueError("sft: no demonstration fits model.max_seq_len")
    s = cfg.sft
    optim = OptimSection(lr=s.lr, min_lr=s.min_lr, warmup_steps=s.warmup_steps, clip_grad=1.0)
    sinks = stage_sinks(cfg.run, "sft", run.path / "sft", to_dict(cfg), ctx.rank == 0)  # W&B missing: said now
    actor = C.build_actor(cfg, model_dir, ctx=ctx, optim=optim, total_steps=s.steps, init=str(model_dir))
    rng = random.Random(cfg.run.seed)
    console = Console(cfg.run.console if ctx.rank == 0 else "none", total=s.steps, title="sao sft")
    metrics_path = run.path / "sft" / "metrics.jsonl"
    if ctx.rank == 0:
        metrics_path.parent.mkdir(parents=True, exist_ok=True)
        metrics_path.write_text("")
    loss_fn = sft_loss_fn()
    t_start = time.monotonic()
    try:
        for step in range(s.steps):
            rows = sorted((kept[rng.randrange(len(kept))] for _ in range(s.batch_size)), key=lambda e: len(e[0]))
            # Sorted by length, each micro-batch trims to its own longest row (see forward.trim_columns).
            batch = pad_examples(rows, formatter.pad_token_id)
            res = actor.train_step(batch, loss_fn)
            if ctx.rank == 0:
                m = {"step": step, "loss": res.loss, "grad_norm": res.grad_norm, "lr": res.metrics.get("lr"),
                     "skipped": res.skipped, "elapsed_s": time.monotonic() - t_start}
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(jsonable(m), allow_nan=False) + "\n")  # a NaN loss as "nan": strict JSON
                sinks.write(m, step)
                console.update({"step": step, "loss": res.loss})
    finally:
        sinks.close()
        console.close()
    out = run.path / "sft_model"
    export_hf_model(actor, model_dir, out)
    if ctx.rank == 0 and s.eval:
        from megatron_sao.trainer.evaluate import evaluate_model_dir

        res = evaluate_model_dir(cfg, out, run.path / "eval" / "sft_model.jsonl")
        (run.path / "sft" / "eval.json").write_text(json.dumps(res))
        logger.info("sft model: eval accuracy %.3f on %d tasks", res["accuracy"], res["n"])
        print(json.dumps({"stage": "sft", "eval_accuracy": res["accuracy"], "n": res["n"]}), flush=True)
    return out


def main(args) -> int:
    cfg = load_config(args.config, args.overrides)
    run_sft(cfg)
    return 0
