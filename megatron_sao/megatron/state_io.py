"""Engine checkpoints for exact resume at the same parallel layout.

Layout on disk (a shared filesystem when ranks span nodes):
  <dir>/meta.json            role, spec, parallel sizes, world size, state_version
  <dir>/rank_00000.pt ...    per rank: module state dict (local shards), each sub-optimizer's inner
                             torch optimizer state (Adam moments of this rank's shard), the fp32
                             main-parameter shards (bf16 runs), the LR scheduler, torch RNG state
Saving is atomic: every rank writes into <dir>.tmp, then rank 0 swaps it into place after a
barrier, so a crash mid-save never leaves a half-written <dir>. Loading checks the layout first
and says what differs. This is not a resharding format: convert through HF (export_hf_weights /
checkpoint.convert) to change TP/PP/EP.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

from megatron_sao.megatron.optimizer import sub_optimizers

_FORMAT = "megatron_sao.engine/1"


def _layout_meta(engine) -> dict:
    c = engine.ctx
    return {"format": _FORMAT, "role": engine.role, "spec": engine.spec.to_dict(),
            "tp": c.tp, "pp": c.pp, "ep": c.ep, "etp": c.etp, "sequence_parallel": c.sequence_parallel,
            "world_size": c.world_size,
            "distributed_optimizer": engine.optim_config.use_distributed_optimizer}


def _main_params(opt) -> list[torch.Tensor]:
    """fp32 master copies that are not views of the model weights (bf16/fp16 training only)."""
    groups = getattr(opt, "shard_fp32_from_float16_groups", None) or getattr(opt, "fp32_from_float16_groups", None)
    return [p for g in (groups or []) for p in g]


def _rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank_{rank:05d}.pt")


def save_engine_state(engine, path: str) -> None:
    path = os.path.abspath(path)
    tmp = path + ".tmp"
    rank = engine.ctx.rank
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    state = {
        "module": {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items() if torch.is_tensor(v)},
        "optimizers": [opt.optimizer.state_dict() for opt in sub_optimizers(engine.optimizer)],
        "main_params": [[p.detach().cpu().clone() for p in _main_params(opt)]
                        for opt in sub_optimizers(engine.optimizer)],
        "scheduler": engine.scheduler.state_dict(),
        "rng": torch.get_rng_state(),
    }
    torch.save(state, _rank_file(tmp, rank))
    dist.barrier()
    if rank == 0:
        meta = dict(_layout_meta(engine), state_version=engine.state_version)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        old = path + ".old"
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def load_engine_state(engine, path: str) -> None:
    path = os.path.abspath(path)
    meta_file = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_file):
        raise FileNotFoundError(f"no engine checkpoint at {path} (missing meta.json)")
    with open(meta_file) as f:
        meta = json.load(f)
    expected = _layout_meta(engine)
    diff = {k: (meta.get(k), v) for k, v in expected.items() if meta.get(k) != v}
    if diff:
        raise ValueError(f"engine checkpoint {path} does not match this engine (saved, current): {diff}")
    state = torch.load(_rank_file(path, engine.ctx.rank), map_location="cpu", weights_only=False)
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
