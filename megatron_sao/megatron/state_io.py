"""Reader of the engine checkpoints written before distributed checkpoints (format megatron_sao.engine/1).

Layout on disk: <dir>/meta.json (role, spec, parallel sizes, world size, state_version) and one
<dir>/rank_NNNNN.pt per rank (module state dict of its shards, each sub-optimizer's inner torch state, the
fp32 main-parameter shards of bf16 runs, the LR scheduler, the rank's torch RNG state). Such a checkpoint
holds per-rank optimizer shards, so it loads only at the layout that wrote it. Nothing writes it any more
(`dist_state.py` does); a run that has one resumes at that layout once, and its next checkpoint is
distributed and loads at any layout.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_sao.megatron.optimizer import sub_optimizers


def _layout_meta(engine) -> dict:
    c = engine.ctx
    return {"format": "megatron_sao.engine/1", "role": engine.role, "spec": engine.spec.to_dict(),
            "tp": c.tp, "pp": c.pp, "ep": c.ep, "etp": c.etp, "sequence_parallel": c.sequence_parallel,
            "world_size": c.world_size,
            "distributed_optimizer": engine.optim_config.use_distributed_optimizer}


def _main_params(opt) -> list[torch.Tensor]:
    """fp32 master copies that are not views of the model weights (bf16/fp16 training only)."""
    groups = getattr(opt, "shard_fp32_from_float16_groups", None) or getattr(opt, "fp32_from_float16_groups", None)
    return [p for g in (groups or []) for p in g]


def load_engine_state(engine, path: str, meta: dict) -> None:
    """Load a per-rank checkpoint at the layout that wrote it; at any other, say how to get one that reshards."""
    expected = _layout_meta(engine)
    diff = {k: (meta.get(k), v) for k, v in expected.items() if meta.get(k) != v}
    if diff:
        saved = {k: meta.get(k) for k in ("tp", "pp", "ep", "etp", "sequence_parallel", "world_size")}
        raise ValueError(
            f"engine checkpoint {path} is a per-rank checkpoint (format megatron_sao.engine/1, written before "
            f"distributed checkpoints): it loads only at the layout that wrote it, {saved}; this engine differs "
            f"(saved, current): {diff}. Convert it by resuming once at that layout (`sao train --resume` with "
            "parallel.* and the number of ranks as saved, run.save_every=1 or a stop after one step): the "
            "checkpoint that run writes is a distributed one and loads at any layout.")
    state = torch.load(os.path.join(path, f"rank_{engine.ctx.rank:05d}.pt"), map_location="cpu", weights_only=False)
    missing, unexpected = engine.module.load_state_dict(state["module"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"engine checkpoint {path}: missing {missing}, unexpected {unexpected}")
    subs = sub_optimizers(engine.optimizer)
    if len(subs) != len(state["optimizers"]):
        raise ValueError(f"engine checkpoint {path} has {len(state['optimizers'])} optimizers, engine has {len(subs)}")
    for opt, opt_state, mains in zip(subs, state["optimizers"], state["main_params"]):
        opt.optimizer.load_state_dict(opt_state)
        targets = _main_params(opt)
        if len(targets) != len(mains):
            raise ValueError(f"engine checkpoint {path}: {len(mains)} main params saved, {len(targets)} expected")
        with torch.no_grad():
            for dst, src in zip(targets, mains):
                dst.copy_(src)
    engine.scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    engine.state_version = int(meta["state_version"])
    dist.barrier()
