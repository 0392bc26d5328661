"""The balanced, budgeted batch plan against the contiguous rule it replaced, on 2 ranks at EP 2.

Usage: torchrun --nproc_per_node 2 -m tests.integration.megatron.workers.engine_balanced <tmp_dir> <dispatcher> ...
  (allgather | alltoall)
For each dispatcher (allgather: the CPU build's, alltoall: the GPU path's), on a tiny Qwen3-MoE and a
long-tailed batch: actor log-probs and critic values of both plans, one actor (NLL) and one critic (MSE)
train step without clipping, and every parameter's reduced gradient compared; plus the
forward counts of the plan without the equal-count rule (unequal: without equalisation the alltoall
dispatcher's collectives would wait forever). Rank 0 prints one RESULT line per dispatcher.
"""

from __future__ import annotations

import gc
import os
import sys

import torch
import torch.distributed as dist

# engine_common first: it applies the CPU patches before any Megatron module is imported.
from tests.integration.megatron.workers.engine_common import emit, mse_loss, nll_loss, tiny_model_dir

# isort: split
from megatron_sao.megatron import batching
from megatron_sao.megatron.compute_cost import CostModel
from megatron_sao.megatron.engine import InitSource, MegatronEngine
from megatron_sao.megatron.optimizer import OptimConfig
from megatron_sao.megatron.parallel import destroy_parallel, init_parallel
from megatron_sao.models.parallel_sizes import ParallelSizes

# Long tail: one row fills the batch width, most are short. The budget (24 tokens) puts the long rows
# alone and packs the short ones; micro_batch_size 4 caps the packing.
LENGTHS = [48, 3, 5, 31, 8, 2, 17, 4, 6, 3, 40, 5, 2]
BUDGET, MBS_NEW, MBS_OLD = 48, 4, 2


def long_tailed_batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    rows, cols = len(LENGTHS), max(LENGTHS)
    attn = torch.zeros(rows, cols, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        attn[i, :n] = True
    action = attn.clone()
    action[:, :1] = False
    return dict(tokens=torch.randint(0, vocab, (rows, cols), generator=g) * attn, attention_mask=attn,
                action_mask=action, returns=torch.randn(rows, cols, generator=g))


def grads(engine) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().clone() for n, p in engine.module.named_parameters()
            if p.requires_grad and getattr(p, "main_grad", None) is not None}


def max_diff(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    d = torch.tensor([float((torch.as_tensor(a) - torch.as_tensor(b)).abs().max())])
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    return float(d)


def run(dispatcher: str, hf_dir: str, spec) -> dict:
    sizes = ParallelSizes(ep=2, etp=1)
    ctx = init_parallel(sizes)
    # Grads are read after the step: no clipping, and the plain optimizer, so every rank's grad buffer
    # holds the whole reduced gradient (the distributed one reduce-scatters: a rank holds its shard).
    opt = OptimConfig(lr=1e-3, clip_grad=0.0, use_distributed_optimizer=False)
    batch = long_tailed_batch(spec.vocab_size)
    out: dict = {}
    results = {}
    for assignment in ("contiguous", "balanced"):
        kw = dict(micro_batch_size=MBS_OLD) if assignment == "contiguous" else dict(
            micro_batch_size=MBS_NEW, max_tokens_per_micro_batch=BUDGET)
        common = dict(init=InitSource.from_hf(hf_dir), ctx=ctx, assignment=assignment,
                      config_overrides={"moe_token_dispatcher_type": dispatcher}, **kw)
        actor = MegatronEngine(spec, sizes, opt, role="actor", **common)
        lp = actor.logprobs(batch)
        a_step = actor.train_step(batch, nll_loss)
        a_grads = grads(actor)
        critic = MegatronEngine(spec, sizes, opt, role="critic", **common)
        v = critic.values(batch)
        c_step = critic.train_step(batch, mse_loss)
        c_grads = grads(critic)
        plan = actor.plan(batch)
        results[assignment] = dict(lp=lp, a_loss=a_step.loss, a_grads=a_grads, v=v, c_loss=c_step.loss,
                                   c_grads=c_grads, a_norm=a_step.grad_norm, c_norm=c_step.grad_norm,
                                   plan_metrics={k: v for k, v in a_step.metrics.items() if k.startswith("plan/")},
                                   calls=[len(s) for s in plan.per_rank],
                                   widths=[[s.width for s in slots] for slots in plan.per_rank])
        del actor, critic
        gc.collect()
    old, new = results["contiguous"], results["balanced"]
    out["logprobs_diff"] = max_diff(old["lp"], new["lp"])
    out["values_diff"] = max_diff(old["v"], new["v"])
    out["actor_loss_diff"] = abs(old["a_loss"] - new["a_loss"])
    out["critic_loss_diff"] = abs(old["c_loss"] - new["c_loss"])
    out["actor_grad_diff"] = max(max_diff(old["a_grads"][k], new["a_grads"][k]) for k in old["a_grads"])
    out["critic_grad_diff"] = max(max_diff(old["c_grads"][k], new["c_grads"][k]) for k in old["c_grads"])
    out["actor_grad_max"] = max(float(g.abs().max()) for g in old["a_grads"].values())
    out["n_grads"] = len(old["a_grads"])
    out["actor_grad_norm_diff"] = abs(old["a_norm"] - new["a_norm"])
    out["critic_grad_norm_diff"] = abs(old["c_norm"] - new["c_norm"])
    out["balanced_calls"], out["balanced_widths"] = new["calls"], new["widths"]
    out["contiguous_widths"] = old["widths"]
    out["plan_metrics"] = {"contiguous": old["plan_metrics"], "balanced": new["plan_metrics"]}
    unequal = batching.plan_balanced(batching.row_lengths(batch), dp=2, micro_batch_size=MBS_NEW,
                                     max_tokens=BUDGET, seq_multiple=1,
                                     cost=CostModel.for_model(spec), rule=batching.ShapeRule())
    out["calls_without_equal_count"] = [len(s) for s in unequal.per_rank]
    out["rows_per_rank"] = [len(unequal.rows_of(r)) for r in range(2)]
    destroy_parallel(destroy_process_group=False)
    return out


tmp = sys.argv[1]
dist.init_process_group("gloo")
spec, _ = tiny_model_dir(os.path.join(tmp, "hf"))
for name in sys.argv[2:]:
    res = run(name, os.path.join(tmp, "hf"), spec)
    if dist.get_rank() == 0:
        emit(name, res)
dist.barrier()
if dist.get_rank() == 0:
    print("ENGINE_BALANCED DONE", flush=True)
dist.destroy_process_group()
