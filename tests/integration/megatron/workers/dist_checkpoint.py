"""Distributed checkpoints saved at one layout and resumed at another
(tests/integration/megatron/test_dist_checkpoint.py).

Usage: torchrun --nproc_per_node N -m tests.integration.megatron.workers.dist_checkpoint <tmp_dir> save|resume

save (2 ranks): at each of tp2sp_ep2, pp2 and dp2 the actor (at tp2sp_ep2 also the critic, attention frozen)
  starts from the tiny Qwen3-MoE HF model, trains on batch 0, is saved to <tmp>/<layout>/<role>, and trains
  on batches 1 and 2 (an uninterrupted run at that layout). At tp2sp_ep2 both saves are asynchronous and in
  flight together while both engines train on batches 1 and 2: the checkpoints must hold the state of the
  save, not of the steps that ran while they were written. Then the tp2sp_ep2 checkpoint (plain optimizer)
  is loaded at dp2 (distributed optimizer over 2 ranks) and the pp2 one at tp2sp (experts split over TP:
  ETP 2), each saved again and trained on batches 1 and 2.
resume (1 rank): the uninterrupted run at tp1; every checkpoint loaded at tp1, saved again and trained on
  batches 1 and 2; every re-saved checkpoint compared with its original tensor by tensor; a per-rank
  checkpoint of the old format loaded at its own layout.
Rank 0 prints `RESULT <tag> <json>` lines.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist

# engine_common first: it applies the CPU patches before any Megatron module is imported.
from tests.integration.megatron.workers.engine_common import emit, make_batch, mse_loss, nll_loss, tiny_model_dir

# isort: split
from megatron_sao.megatron.engine import InitSource, MegatronEngine
from megatron_sao.megatron.optimizer import OptimConfig, sub_optimizers
from megatron_sao.megatron.parallel import destroy_parallel, init_parallel
from megatron_sao.models.freeze import CRITIC_FROZEN_ATTENTION
from megatron_sao.models.parallel_sizes import ParallelSizes

LAYOUTS = {"tp2sp_ep2": ParallelSizes(tp=2, ep=2, sequence_parallel=True, etp=1), "pp2": ParallelSizes(pp=2),
           "dp2": ParallelSizes(), "tp1": ParallelSizes(),
           "tp2sp": ParallelSizes(tp=2, sequence_parallel=True)}  # experts split over TP: ETP 2
WITH_CRITIC = ("tp2sp_ep2",)
OPT = OptimConfig(lr=1e-2, clip_grad=1.0)


def build(role: str, sizes: ParallelSizes, ctx, hf_dir: str | None, spec) -> MegatronEngine:
    init = InitSource.from_hf(hf_dir) if hf_dir else InitSource.random(11)  # random: overwritten by a load
    return MegatronEngine(spec, sizes, OPT, role=role, init=init, micro_batch_size=2, ctx=ctx,
                          freeze_patterns=CRITIC_FROZEN_ATTENTION if role == "critic" else ())


def steps(engine: MegatronEngine, batches: list) -> list[float]:
    loss = nll_loss if engine.role == "actor" else mse_loss
    return [engine.train_step(b, loss).loss for b in batches]


def roles(layout: str) -> list[str]:
    return ["actor", "critic"] if layout in WITH_CRITIC else ["actor"]


def compare(original: str, resaved: str, vocab: int) -> dict:
    """Every tensor of two checkpoints of the same state, read whole: vocabulary rows past the real
    vocabulary are padding whose count depends on TP, so those tensors compare their first `vocab` rows."""
    from megatron.core.dist_checkpointing import load_plain_tensors

    a, b = ({k: v for k, v in load_plain_tensors(d).items() if torch.is_tensor(v)} for d in (original, resaved))
    worst = 0.0
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        if x.shape != y.shape and x.shape[1:] == y.shape[1:]:
            x, y = x[:vocab], y[:vocab]
        worst = max(worst, (x.float() - y.float()).abs().max().item()) if x.shape == y.shape else float("inf")
    return {"keys": len(a), "only_original": sorted(set(a) - set(b))[:5], "only_resaved": sorted(set(b) - set(a))[:5],
            "optimizer_keys": sum(k.startswith("optimizer.state.") for k in a), "max_abs_diff": worst}


def write_old_format(engine: MegatronEngine, path: str) -> None:
    """A per-rank checkpoint as the trainer wrote them before distributed checkpoints (format engine/1)."""
    c = engine.ctx
    os.makedirs(path, exist_ok=True)
    module = {k: v.detach().clone() for k, v in engine.module.state_dict().items() if torch.is_tensor(v)}
    torch.save({"module": module, "optimizers": [o.optimizer.state_dict() for o in sub_optimizers(engine.optimizer)],
                "main_params": [[] for _ in sub_optimizers(engine.optimizer)],
                "scheduler": engine.scheduler.state_dict(), "rng": torch.get_rng_state()},
               os.path.join(path, f"rank_{c.rank:05d}.pt"))
    meta = {"format": "megatron_sao.engine/1", "role": engine.role, "spec": engine.spec.to_dict(), "tp": c.tp,
            "pp": c.pp, "ep": c.ep, "etp": c.etp, "sequence_parallel": c.sequence_parallel, "world_size": c.world_size,
            "distributed_optimizer": engine.optim_config.use_distributed_optimizer,
            "state_version": engine.state_version}
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)


def resume_at(layout: str, source: str, tmp: str, spec, batches: list, reference: dict) -> dict:
    """Load `source`'s checkpoints at `layout`, save them again, train on batches 1 and 2."""
    sizes = LAYOUTS[layout]
    ctx = init_parallel(sizes)
    out = {}
    for role in roles(source):
        engine = build(role, sizes, ctx, None, spec)
        record = engine.load(os.path.join(tmp, source, role))
        resaved = os.path.join(tmp, f"{source}_at_{layout}", role)
        engine.save(resaved)
        out[role] = {"saved_layout": record["layout"], "state_version": engine.state_version,
                     "optimizer": [type(o).__name__ for o in sub_optimizers(engine.optimizer)],
                     "losses": steps(engine, batches[1:]), "reference": reference[role]}
        del engine
        gc.collect()
    destroy_parallel(destroy_process_group=False)
    return out


def save_phase(tmp: str, spec, hf_dir: str, batches: list) -> None:
    from megatron_sao.megatron.async_saves import AsyncSaves

    uninterrupted, saves = {}, AsyncSaves()
    for layout in ("tp2sp_ep2", "pp2", "dp2"):
        sizes = LAYOUTS[layout]
        ctx = init_parallel(sizes)
        engines = {role: build(role, sizes, ctx, hf_dir, spec) for role in roles(layout)}
        first = {role: steps(engine, batches[:1]) for role, engine in engines.items()}
        asynchronous = layout == "tp2sp_ep2"
        requests = [e.save(os.path.join(tmp, layout, role), asynchronous=asynchronous) for role, e in engines.items()]
        if asynchronous:
            saves.schedule(requests, lambda: None)
        for role, engine in engines.items():
            uninterrupted[(layout, role)] = first[role] + steps(engine, batches[1:])
        saves.wait()
        del engines
        gc.collect()
        destroy_parallel(destroy_process_group=False)
        if dist.get_rank() == 0:
            emit(f"uninterrupted_{layout}", {r: uninterrupted[(layout, r)] for r in roles(layout)})
    ref = {"actor": uninterrupted[("dp2", "actor")][1:], "critic": None}
    result = resume_at("dp2", "tp2sp_ep2", tmp, spec, batches, ref)
    if dist.get_rank() == 0:
        emit("tp2sp_ep2_at_dp2", result)
    result = resume_at("tp2sp", "pp2", tmp, spec, batches, {"actor": None})  # PP 2 -> TP 2 with ETP 2
    if dist.get_rank() == 0:
        emit("pp2_at_tp2sp", result)


def resume_phase(tmp: str, spec, hf_dir: str, batches: list) -> None:
    ctx = init_parallel(LAYOUTS["tp1"])
    reference = {}
    for role in ("actor", "critic"):
        engine = build(role, LAYOUTS["tp1"], ctx, hf_dir, spec)
        reference[role] = steps(engine, batches[:1])
        if role == "actor":  # the old per-rank format at its own layout: the next step as if never saved
            write_old_format(engine, os.path.join(tmp, "old_format"))
            twin = build("actor", LAYOUTS["tp1"], ctx, None, spec)
            twin.load(os.path.join(tmp, "old_format"))
            emit("old_format_same_layout", {"twin": steps(twin, batches[1:2]), "original": steps(engine, batches[1:2])})
            del twin
            engine = build(role, LAYOUTS["tp1"], ctx, hf_dir, spec)
            steps(engine, batches[:1])
        reference[role] = steps(engine, batches[1:])
        del engine
        gc.collect()
    destroy_parallel(destroy_process_group=False)
    for source in ("tp2sp_ep2", "pp2", "dp2"):
        result = resume_at("tp1", source, tmp, spec, batches, reference)
        for role in result:
            result[role]["tensors"] = compare(os.path.join(tmp, source, role),
                                              os.path.join(tmp, f"{source}_at_tp1", role), spec.vocab_size)
        emit(f"{source}_at_tp1", result)
    for role in roles("tp2sp_ep2"):  # the re-saves of the launch before
        emit(f"tp2sp_ep2_at_dp2_tensors_{role}", compare(os.path.join(tmp, "tp2sp_ep2", role),
                                                          os.path.join(tmp, "tp2sp_ep2_at_dp2", role), spec.vocab_size))
    emit("pp2_at_tp2sp_tensors_actor", compare(os.path.join(tmp, "pp2", "actor"),
                                               os.path.join(tmp, "pp2_at_tp2sp", "actor"), spec.vocab_size))


def main() -> None:
    tmp, phase = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    spec, _ = tiny_model_dir(os.path.join(tmp, "hf"))
    batches = [make_batch(spec.vocab_size, seed=7 + i) for i in range(3)]
    (save_phase if phase == "save" else resume_phase)(tmp, spec, os.path.join(tmp, "hf"), batches)
    dist.barrier()
    if dist.get_rank() == 0:
        print("DIST_CHECKPOINT DONE", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
