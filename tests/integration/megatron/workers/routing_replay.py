"""Rollout routing replay through the Megatron actor, on several layouts in ONE launch.

Usage: torchrun --nproc_per_node 2 -m tests.integration.megatron.workers.routing_replay <tmp_dir> [layout ...]
  (ep2, tp2sp_ep2, pp2, dp2)
For each layout, with the tiny Qwen3-MoE:
- `forced`: routes that are NOT the model's own (a random distinct top-k per token x layer) replayed
  by the actor: its log-probs vs the HF model with those experts forced (a forward hook makes each HF
  router return them) and vs free routing; the agreement metric with replay on (the trainer's own
  choice still differs: < 1);
- `own`: the HF model's own routes, replay off: agreement 1.0 (fp32 on both sides);
- `train`: one NLL step with the forced routes replayed, without and with full activation recompute
  (recompute must replay the same routes: equal loss and grad norm); the logprobs after it.
Rank 0 prints RESULT lines.
"""

from __future__ import annotations

import gc
import os
import sys

import torch
import torch.distributed as dist

# engine_common first: it applies the CPU patches before any Megatron module is imported.
from tests.integration.megatron.workers.engine_common import emit, hf_logprobs, make_batch, nll_loss, tiny_model_dir

# isort: split
from megatron_sao.megatron.engine import InitSource, MegatronEngine
from megatron_sao.megatron.optimizer import OptimConfig
from megatron_sao.megatron.parallel import destroy_parallel, init_parallel
from megatron_sao.models.parallel_sizes import ParallelSizes

LAYOUTS = {
    "dp2": ParallelSizes(),
    "ep2": ParallelSizes(ep=2, etp=1),
    "tp2sp_ep2": ParallelSizes(tp=2, ep=2, sequence_parallel=True, etp=1),
    "pp2": ParallelSizes(pp=2),
}
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def hf_routers(hf):
    return [m for m in hf.modules() if type(m).__name__.endswith("TopKRouter")]


def hf_own_routes(hf, tokens: torch.Tensor) -> torch.Tensor:
    """[B, T, layers, topk] of the HF model's own routing."""
    seen = []
    hooks = [r.register_forward_hook(lambda m, a, out: seen.append(out[2])) for r in hf_routers(hf)]
    with torch.no_grad():
        hf(input_ids=tokens)
    for h in hooks:
        h.remove()
    b, t = tokens.shape
    return torch.stack([s.reshape(b, t, -1) for s in seen], dim=2)


def hf_forced_logprobs(hf, batch, routes: torch.Tensor) -> torch.Tensor:
    """HF log-probs with every router made to choose `routes` [B, T, layers, topk] (its own
    probabilities at those experts, renormalised as Qwen3-MoE's norm_topk_prob does)."""
    b, t = batch["tokens"].shape

    def force(layer):
        def hook(module, args, out):
            logits = out[0]
            idx = routes[:, :, layer].reshape(b * t, -1).to(torch.int64)
            probs = torch.softmax(logits.float(), dim=-1).gather(1, idx)
            if module.norm_topk_prob:
                probs = probs / probs.sum(dim=-1, keepdim=True)
            return logits, probs.to(logits.dtype), idx
        return hook

    hooks = [r.register_forward_hook(force(i)) for i, r in enumerate(hf_routers(hf))]
    try:
        return hf_logprobs(hf, batch)
    finally:
        for h in hooks:
            h.remove()


def other_routes(own: torch.Tensor, experts: int, seed: int) -> torch.Tensor:
    """Distinct top-k sets that differ from `own` on most token x layer entries."""
    g = torch.Generator().manual_seed(seed)
    b, t, layers, k = own.shape
    return torch.rand((b, t, layers, experts), generator=g).argsort(dim=-1)[..., :k]


tmp = sys.argv[1]
names = sys.argv[2:] or list(LAYOUTS)
dist.init_process_group("gloo")
rank = dist.get_rank()
hf_dir = os.path.join(tmp, "hf")
spec, hf = tiny_model_dir(hf_dir)
batch = make_batch(spec.vocab_size)
mask = batch["attention_mask"]
own = hf_own_routes(hf, batch["tokens"])
forced = other_routes(own, spec.num_experts, seed=3)
# Tokens with a route: all real tokens but each row's last (what an engine returns); +1 encoding.
routed = mask & torch.roll(mask, -1, dims=1)
routed[:, -1] = False
enc = lambda r: ((r.to(torch.int16) + 1) * routed[:, :, None, None]).to(torch.int16)  # noqa: E731
lp_free_hf = hf_logprobs(hf, batch)
lp_forced_hf = hf_forced_logprobs(hf, batch, forced)
opt = OptimConfig(lr=1e-2, clip_grad=1.0)

def held_targets(engine) -> list[int]:
    """Records how many micro-batches' targets each router holds for the backward pass after each forward
    set them (Megatron's replay_backward_list)."""
    held = []
    for _, rep in engine.routing.routers:
        def set_target_indices(idx, rep=rep, own=rep.set_target_indices):
            own(idx)
            held.append(len(rep.replay_backward_list))
        rep.set_target_indices = set_target_indices
    return held


for name in names:
    sizes = LAYOUTS[name]
    ctx = init_parallel(sizes)
    out = {"ctx": ctx.describe()}

    def actor(**overrides):
        return MegatronEngine(spec, sizes, opt, role="actor", init=InitSource.from_hf(hf_dir), micro_batch_size=2,
                              ctx=ctx, config_overrides=overrides or None)

    a = actor()
    held = held_targets(a)
    a.replay_routes = True
    lp_replay = a.logprobs({**batch, "routes": enc(forced)})
    out["forced_agreement_replay_on"] = a.last_routing_agreement["moe/routing_agreement"]
    out["forced_used_replay_on"] = a.last_routing_agreement["moe/routing_agreement_used"]
    out["forced_vs_hf_forced"] = (lp_replay - lp_forced_hf).abs().max().item()
    out["forced_vs_hf_free"] = (lp_replay - lp_free_hf).abs().max().item()
    out["hf_forced_vs_free"] = (lp_forced_hf - lp_free_hf).abs().max().item()
    a.replay_routes = False
    lp_measure = a.logprobs({**batch, "routes": enc(own)})
    out["own_agreement_replay_off"] = a.last_routing_agreement["moe/routing_agreement"]
    out["own_measure_vs_hf_free"] = (lp_measure - lp_free_hf).abs().max().item()
    lp_measure_forced = a.logprobs({**batch, "routes": enc(forced)})
    out["forced_agreement_replay_off"] = a.last_routing_agreement["moe/routing_agreement"]
    out["forced_used_replay_off"] = a.last_routing_agreement["moe/routing_agreement_used"]
    out["forced_measure_vs_hf_free"] = (lp_measure_forced - lp_free_hf).abs().max().item()
    if sizes.pp > 1:  # issue 39: a stage of dense layers (no router) must still join the agreement's all-reduce
        routers = a.routing.routers
        if not ctx.is_first_stage:
            a.routing.routers = []
        a.logprobs({**batch, "routes": enc(own)})
        out["agreement_with_a_routerless_stage"] = a.last_routing_agreement.get("moe/routing_agreement")
        a.routing.routers = routers
    a.replay_routes = True
    step = a.train_step({**batch, "routes": enc(forced)}, nll_loss)
    out["train_agreement"] = step.metrics.get("moe/routing_agreement")
    out["train_used"] = step.metrics.get("moe/routing_agreement_used")
    out["train_loss"], out["train_grad_norm"] = step.loss, step.grad_norm
    out["train_loss_vs_hf_forced"] = abs(step.loss + (lp_forced_hf * batch["action_mask"]).sum().item()
                                         / batch["action_mask"].sum().item())
    # the targets set after a set_target_indices call; grows only while the previous one is still held
    out["held_targets_max_no_recompute"] = max(held)
    del a
    gc.collect()
    r = actor(**RECOMPUTE)
    held_rc = held_targets(r)
    r.replay_routes = True
    step_r = r.train_step({**batch, "routes": enc(forced)}, nll_loss)
    out["held_targets_max_recompute"] = max(held_rc)
    out["recompute_loss_diff"] = abs(step_r.loss - step.loss)
    out["recompute_grad_norm_diff"] = abs(step_r.grad_norm - step.grad_norm)
    out["recompute_grad_norm"] = step_r.grad_norm
    out["recomputed_forwards"] = sum(rep.recomputed for _, rep in r.routing.routers)
    out["local_routers"] = len(r.routing.routers)
    del r
    gc.collect()
    if rank == 0:
        emit(name, out)
    destroy_parallel(destroy_process_group=False)
dist.barrier()
if rank == 0:
    print("ROUTING_REPLAY DONE", flush=True)
dist.destroy_process_group()
