"""Multi-rank engine checks over several layouts in ONE launch.

Usage: torchrun --nproc_per_node 2 -m tests.integration.megatron.workers.engine_parallel <tmp_dir> [layout ...]
Layouts (world size 2): dp2, tp2sp, ep2, pp2, tp2sp_ep2; (world size 4): tp2sp_pp2_ep2, and
tp4_v50257 / tp2sp_v50257 (a Llama with GPT-2's odd vocabulary, 50257 rows padded to 50688 / 50432).
For each layout: actor log-probs vs the HF model, HF export vs the source safetensors (rank 0), one
DIS-free NLL train step (loss, grad norm, post-step log-probs) and critic values; rank 0 prints
RESULT lines and compares every layout's train step and values with the first layout's of the same
model.
"""

from __future__ import annotations

import gc
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file

# engine_common first: it applies the CPU patches before any Megatron module is imported.
from tests.integration.megatron.workers.engine_common import emit, hf_logprobs, make_batch, nll_loss, tiny_model_dir

# isort: split
from megatron_sao.megatron.engine import InitSource, MegatronEngine
from megatron_sao.megatron.optimizer import OptimConfig, sub_optimizers
from megatron_sao.megatron.parallel import destroy_parallel, init_parallel
from megatron_sao.models.parallel_sizes import ParallelSizes

# Model of a layout (default qwen3_moe): HF config overrides of the tiny preset.
MODELS = {"qwen3_moe": dict(arch="qwen3_moe"),
          "llama_v50257": dict(arch="llama", vocab_size=50257, num_key_value_heads=4, num_hidden_layers=2)}
LAYOUT_MODEL = {"tp4_v50257": "llama_v50257", "tp2sp_v50257": "llama_v50257"}
LAYOUTS = {
    "dp2": ParallelSizes(),
    "tp2sp": ParallelSizes(tp=2, sequence_parallel=True),  # experts TP-sharded (etp = tp)
    "ep2": ParallelSizes(ep=2, etp=1),
    "pp2": ParallelSizes(pp=2),
    "tp2sp_ep2": ParallelSizes(tp=2, ep=2, sequence_parallel=True, etp=1),
    # world size 4: all three at once (EP=2 over the TP ranks, experts whole: etp=1)
    "tp2sp_pp2_ep2": ParallelSizes(tp=2, pp=2, ep=2, sequence_parallel=True, etp=1),
    # world size 4, vocab 50257: no TP divides it; Megatron-style padding (models/vocab.py)
    "tp4_v50257": ParallelSizes(tp=4),
    "tp2sp_v50257": ParallelSizes(tp=2, sequence_parallel=True),
}

tmp = sys.argv[1]
names = sys.argv[2:] or list(LAYOUTS)
dist.init_process_group("gloo")
rank = dist.get_rank()
opt = OptimConfig(lr=1e-2, clip_grad=1.0)
models, firsts = {}, {}
for name in names:
    sizes = LAYOUTS[name]
    model_name = LAYOUT_MODEL.get(name, "qwen3_moe")
    if model_name not in models:
        hf_dir = os.path.join(tmp, "hf" if model_name == "qwen3_moe" else model_name)
        spec, hf = tiny_model_dir(hf_dir, **MODELS[model_name])
        batch = make_batch(spec.vocab_size)
        disk = {}
        for f in sorted(os.listdir(hf_dir)):
            if f.endswith(".safetensors"):
                disk.update(load_file(os.path.join(hf_dir, f)))
        models[model_name] = (hf_dir, spec, batch, hf_logprobs(hf, batch), disk)
    hf_dir, spec, batch, ref_lp, disk = models[model_name]
    ctx = init_parallel(sizes)
    actor = MegatronEngine(spec, sizes, opt, role="actor", init=InitSource.from_hf(hf_dir), micro_batch_size=2, ctx=ctx)
    lp = actor.logprobs(batch)
    exported, n_buckets = {}, 0
    for bucket in actor.export_hf_weights(bucket_bytes=32 << 10):
        n_buckets += 1
        exported.update(dict(bucket))
    step = actor.train_step(batch, nll_loss)
    lp_after = actor.logprobs(batch)
    resumed = None
    if name in ("dp2", "tp2sp"):  # save/load with the distributed optimizer (dp2) and the plain one (tp2sp)
        ckpt = os.path.join(tmp, f"ckpt_{name}")
        actor.save(ckpt)
        twin = MegatronEngine(spec, sizes, opt, role="actor", init=InitSource.random(5), micro_batch_size=2, ctx=ctx)
        twin.load(ckpt)
        a, b = actor.train_step(batch, nll_loss), twin.train_step(batch, nll_loss)
        resumed = {"loss_diff": abs(a.loss - b.loss), "lp_diff": (actor.logprobs(batch) - twin.logprobs(batch))
                   .abs().max().item(), "optimizers": [type(o).__name__ for o in sub_optimizers(actor.optimizer)]}
        del twin
    critic = MegatronEngine(spec, sizes, opt, role="critic", init=InitSource.from_hf(hf_dir), micro_batch_size=2,
                            ctx=ctx)
    values = critic.values(batch)
    # every rank must return the same tensors
    gathered = [torch.empty_like(lp_after) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, lp_after)
    same_on_ranks = all(torch.equal(g, lp_after) for g in gathered)
    if rank == 0:
        cur = {"loss": step.loss, "grad_norm": step.grad_norm, "lp_after": lp_after, "values": values}
        first = firsts.setdefault(model_name, dict(cur, name=name))
        emit(name, {
            "ctx": ctx.describe(),
            "logprobs_vs_hf": (lp - ref_lp).abs().max().item(),
            "export_missing": sorted(set(disk) - set(exported))[:5],
            "export_extra": sorted(set(exported) - set(disk))[:5],
            "export_max_abs_diff": max(((exported[k] - disk[k]).abs().max().item() for k in disk if k in exported),
                                       default=-1.0),
            "n_buckets": n_buckets,
            "loss": step.loss, "grad_norm": step.grad_norm, "skipped": step.skipped,
            "vs_first": first["name"],
            "loss_diff_vs_first": abs(step.loss - first["loss"]),
            "grad_norm_diff_vs_first": abs(step.grad_norm - first["grad_norm"]),
            "lp_after_diff_vs_first": (lp_after - first["lp_after"]).abs().max().item(),
            "lp_changed": (lp_after - lp).abs().max().item(),
            "values_diff_vs_first": (values - first["values"]).abs().max().item(),
            "same_on_ranks": same_on_ranks,
            "resumed": resumed,
        })
    del actor, critic
    gc.collect()
    destroy_parallel(destroy_process_group=False)
dist.barrier()
if rank == 0:
    print("ENGINE_PARALLEL DONE", flush=True)
dist.destroy_process_group()
