"""Single-process engine checks (world size 1).
Usage: python -m tests.integration.megatron.workers.engine_single <tmp_dir>

Prints RESULT lines parsed by tests/integration/megatron/test_engine_single.py.
"""

from __future__ import annotations

import math
import os
import sys

import torch
from safetensors.torch import load_file

# engine_common first: it applies the CPU patches before any Megatron module is imported.
from tests.integration.megatron.workers.engine_common import (
    emit,
    hf_logprobs,
    make_batch,
    mse_loss,
    nll_loss,
    tiny_model_dir,
)

# isort: split
from megatron.core.transformer.attention import SelfAttention

from megatron_sao.algorithms import entropy_bonus
from megatron_sao.megatron.engine import InitSource, MegatronEngine
from megatron_sao.megatron.forward import token_logprobs
from megatron_sao.megatron.optimizer import OptimConfig, model_main_param_pairs, sub_optimizers
from megatron_sao.megatron.parallel import init_parallel
from megatron_sao.models.freeze import CRITIC_FROZEN_ATTENTION
from megatron_sao.models.gpt import build_gpt_model, transformer_config_from_spec
from megatron_sao.models.parallel_sizes import ParallelSizes

tmp = sys.argv[1]
hf_dir = os.path.join(tmp, "hf")
spec, hf = tiny_model_dir(hf_dir)
sizes = ParallelSizes()
ctx = init_parallel(sizes)
batch = make_batch(spec.vocab_size)
OPT = OptimConfig(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, clip_grad=0.5)


def actor(**kw):
    return MegatronEngine(spec, sizes, kw.pop("optim", OPT), role="actor", init=InitSource.from_hf(hf_dir),
                          micro_batch_size=2, ctx=ctx, **kw)


def snapshot(engine):
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def twin_of(engine):
    """A plain torch model with the engine's weights. A fresh config: the engine's carries DDP hooks,
    which the MoE layer's deepcopy cannot pickle."""
    twin = build_gpt_model(spec, transformer_config_from_spec(spec, sizes), role="actor")
    twin.load_state_dict(engine.module.state_dict(), strict=False)
    return twin


def torch_adamw_step(twin, loss, opt: OptimConfig) -> float:
    """Backward `loss`, clip and take torch AdamW's step as the engine's optimizer config says (decay on
    matrices only); returns the gradient norm before clipping."""
    loss.backward()
    params = list(twin.named_parameters())
    norm = torch.nn.utils.clip_grad_norm_([p for _, p in params], opt.clip_grad).item()
    groups = [{"params": [p for _, p in params if p.dim() > 1], "weight_decay": opt.weight_decay},
              {"params": [p for _, p in params if p.dim() <= 1], "weight_decay": 0.0}]
    torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps).step()
    return norm


# 1. logprobs == HF log_softmax
eng = actor()
lp = eng.logprobs(batch)
ref_lp_hf = hf_logprobs(hf, batch)
emit("hf_logprobs", {"max_abs_diff": (lp - ref_lp_hf).abs().max().item(), "shape": list(lp.shape)})

# 2. one engine step == torch AdamW on a twin model (same weights), with clipping active
twin = twin_of(eng)
before = snapshot(eng)
res = eng.train_step(batch, nll_loss)
pos = torch.arange(batch["tokens"].shape[1])[None].expand_as(batch["tokens"])
ref_lp = token_logprobs(twin(batch["tokens"], pos, None), batch["tokens"])
mask = batch["action_mask"].float()
ref_loss = -(ref_lp * mask).sum() / mask.sum()
ref_norm = torch_adamw_step(twin, ref_loss, OPT)
emit("adamw_ref", {
    "param_max_abs_diff": max_diff(snapshot(eng), dict(twin.named_parameters())),
    "param_change": max_diff(snapshot(eng), before),
    "loss": res.loss, "ref_loss": ref_loss.item(), "grad_norm": res.grad_norm, "ref_grad_norm": ref_norm,
    "skipped": res.skipped, "distributed_optimizer": type(eng.optimizer).__name__,
    "state_version": eng.state_version})

# 2b. the entropy bonus alone (algorithm.entropy_coef): the engine's step == torch AdamW on a twin whose
#     loss is -mean entropy of the full softmax; a second step starts from a wider policy
def entropy_only(o, mb, d):
    return entropy_bonus(mb["entropy"], mb["action_mask"].bool(), 1.0, loss_denominator=d), {}


# Adam eps 1e-4, not 1e-8: Adam's first step is lr * g / (|g| + eps), so at 1e-8 every gradient above
# ~1e-8 moves its weight by the full lr, and the fp32 rounding of the near-zero gradients (the entropy's
# gradient sums terms that cancel) decides those moves; the gradient norm is compared exactly either way.
OPT_E = OptimConfig(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-4, clip_grad=0.5)
eng_e = actor(optim=OPT_E)
twin = twin_of(eng_e)
res_e = eng_e.train_step(batch, entropy_only)
after_one = snapshot(eng_e)
res_e2 = eng_e.train_step(batch, entropy_only)
logits = twin(batch["tokens"], pos, None)[:, :-1, :spec.vocab_size].float()
ref_entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
act = batch["action_mask"][:, 1:].float()
ref_mean_entropy = (ref_entropy * act).sum() / act.sum()
ref_norm = torch_adamw_step(twin, -ref_mean_entropy, OPT_E)
emit("entropy_bonus", {
    "param_max_abs_diff": max_diff(after_one, dict(twin.named_parameters())),
    "loss": res_e.loss, "ref_loss": -ref_mean_entropy.item(), "entropy": res_e.metrics["entropy"],
    "grad_norm": res_e.grad_norm, "ref_grad_norm": ref_norm, "entropy_after_one_step": res_e2.metrics["entropy"],
    "skipped": [res_e.skipped, res_e2.skipped]})

# 3. NaN loss -> skipped, params and Adam state unchanged; the next finite step trains again
def adam_steps(engine):
    return [float(st["step"]) for o in sub_optimizers(engine.optimizer) for st in o.optimizer.state.values()]


before, steps_before = snapshot(eng), adam_steps(eng)
res_nan = eng.train_step(batch, lambda o, mb, d: (nll_loss(o, mb, d)[0] * float("nan"), {}))
nan_change, steps_after = max_diff(snapshot(eng), before), adam_steps(eng)
res_ok = eng.train_step(batch, nll_loss)
emit("nan_skip", {"skipped": res_nan.skipped, "param_change": nan_change,
                  "grad_norm_finite": math.isfinite(res_nan.grad_norm),
                  "adam_steps": [steps_before, steps_after], "next_step_skipped": res_ok.skipped,
                  "next_step_change": max_diff(snapshot(eng), before), "state_version": eng.state_version})

# 4. save/load: a step after load equals the step without the save (fp32 and bf16: one rank, so
#    Megatron's plain optimizers, not the distributed one: optimizer.effective_for)
for tag, dtype in (("save_load", torch.float32), ("save_load_bf16", torch.bfloat16)):
    eng_a = actor(params_dtype=dtype)
    eng_a.train_step(batch, nll_loss)
    eng_a.save(os.path.join(tmp, tag))
    r_a = eng_a.train_step(batch, nll_loss)
    eng_b = MegatronEngine(spec, sizes, OPT, role="actor", init=InitSource.random(99), micro_batch_size=2, ctx=ctx,
                           params_dtype=dtype)
    eng_b.load(os.path.join(tmp, tag))
    version_after_load = eng_b.state_version
    r_b = eng_b.train_step(batch, nll_loss)
    emit(tag, {"param_max_abs_diff": max_diff(snapshot(eng_a), snapshot(eng_b)),
               "loss_a": r_a.loss, "loss_b": r_b.loss, "version_after_load": version_after_load,
               "tmp_left": os.path.exists(os.path.join(tmp, tag + ".tmp")),
               "optimizers": [type(o).__name__ for o in sub_optimizers(eng_a.optimizer)]})

# 5. frozen-attention critic: frozen params fixed, trainable ones move; per-group grad norms
groups = {"attention": list(CRITIC_FROZEN_ATTENTION), "moe": ["decoder.layers.*.mlp.*"], "value_head": ["value_head.*"]}
critic = MegatronEngine(spec, sizes, OptimConfig(lr=1e-2), role="critic", init=InitSource.from_hf(hf_dir),
                        micro_batch_size=2, ctx=ctx, freeze_patterns=CRITIC_FROZEN_ATTENTION, grad_norm_groups=groups)
v0 = critic.values(batch)
before = snapshot(critic)
frozen = {n for n, p in critic.module.named_parameters() if not p.requires_grad}
r1 = critic.train_step(batch, mse_loss)
r2 = critic.train_step(batch, mse_loss)
after = snapshot(critic)
emit("frozen_critic", {
    "n_frozen": len(frozen), "n_trainable": len(after) - len(frozen),
    "frozen_max_change": max((after[n] - before[n]).abs().max().item() for n in frozen),
    "trainable_min_change": min((after[n] - before[n]).abs().max().item() for n in after if n not in frozen),
    "values_shape": list(v0.shape), "values_pad_zero": bool((v0[~batch["attention_mask"]] == 0).all()),
    "loss_decreased": r2.loss < r1.loss, "metrics": r1.metrics, "metrics_second": r2.metrics})

# 6. HF export round trip (world size 1)
eng0 = actor()
exported = {}
n_buckets = 0
max_bucket = 0
for bucket in eng0.export_hf_weights(bucket_bytes=64 << 10):
    n_buckets += 1
    if len(bucket) > 1:  # a single oversized tensor may fill a bucket alone
        max_bucket = max(max_bucket, sum(t.numel() * t.element_size() for _, t in bucket))
    exported.update(dict(bucket))
src = hf.state_dict()
disk = {}
for f in os.listdir(hf_dir):
    if f.endswith(".safetensors"):
        disk.update(load_file(os.path.join(hf_dir, f)))
emit("export", {"n_buckets": n_buckets, "max_multi_bucket_bytes": max_bucket,
                "missing": sorted(set(disk) - set(exported))[:5],
                "extra": sorted(set(exported) - set(disk))[:5],
                "max_abs_diff": max((exported[k] - disk[k]).abs().max().item() for k in disk if k in exported)})

# 7. bad input gives clear errors
errors = {}
bad = dict(batch, attention_mask=batch["attention_mask"].flip(1))
for name, b in (("left_pad", bad), ("packed", dict(batch, cu_seqlens=torch.tensor([0, 5]))),
                ("float_tokens", dict(batch, tokens=batch["tokens"].float()))):
    try:
        eng0.logprobs(b)
        errors[name] = "no error"
    except (ValueError, NotImplementedError) as e:
        errors[name] = f"{type(e).__name__}: {e}"
emit("errors", errors)
# 8. attention is causal by mask type: the engine hands the model attention_mask=None in every call
masks = []
hook = eng0.module.register_forward_pre_hook(lambda mod, args, kwargs: masks.append(
    args[2] if len(args) > 2 else kwargs.get("attention_mask", "absent")), with_kwargs=True)
eng0.logprobs(batch)
eng0.train_step(batch, nll_loss)
hook.remove()
emit("attention_mask", {"calls": len(masks), "all_none": all(m is None for m in masks),
                        "engine_mask_cache": hasattr(eng0, "_masks"),
                        "mask_types": sorted({m.attn_mask_type.name for m in eng0.module.modules()
                                              if isinstance(m, SelfAttention)})})

# 9. bf16 mixed precision: bf16 engine vs the fp32 HF model; one step on fp32 main params
eng16 = actor(params_dtype=torch.bfloat16)
lp16 = eng16.logprobs(batch)
diff = (lp16 - ref_lp_hf).abs()[batch["attention_mask"]]
pairs = [pair for o in sub_optimizers(eng16.optimizer) for pair in model_main_param_pairs(o)]
main_before = [m.detach().clone() for _, m in pairs]
r16 = [eng16.train_step(batch, nll_loss) for _ in range(3)]
emit("bf16", {"logprob_max_abs_diff": diff.max().item(), "logprob_mean_abs_diff": diff.mean().item(),
              "config_bf16": eng16.config.bf16, "config_params_dtype": str(eng16.config.params_dtype),
              "model_param_dtypes": sorted({str(p.dtype) for p in eng16.module.parameters()}),
              "main_param_dtypes": sorted({str(m.dtype) for _, m in pairs}),
              "main_params_moved": max((m - b).abs().max().item() for (_, m), b in zip(pairs, main_before)),
              "losses": [r.loss for r in r16], "skipped": [r.skipped for r in r16]})
print("ENGINE_SINGLE DONE", flush=True)
