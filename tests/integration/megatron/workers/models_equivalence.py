"""Megatron actor/critic vs transformers on tiny random models (float32, CPU, gloo).

argv: <dir with one saved HF model per arch> <mode: single|parallel> [megatron ckpt dir of qwen3_moe]
single   (1 rank): logits, loss and grads of qwen3_moe / qwen3 / llama at TP=1; critic values,
         value-head init modes and the frozen-attention preset.
parallel (2 ranks): logits at TP=2+SP, EP=2, PP=2 and TP=2+EP=2 (ETP=1) for qwen3_moe; TP=2+SP and
         PP=2 for the dense models; critic values at TP=2+SP.
Both modes: the qwen3_moe Megatron checkpoint (saved at another layout, e.g. TP2/PP2/EP2) loaded
with load_megatron_checkpoint_into_model gives the HF logits.
Vocabularies are padded as Megatron does (models/vocab.py): the models are built with
padded_vocab_size(V, TP) rows (qwen3_moe 128 -> 256 at TP 2: TP rank 1 holds only padding; qwen3
160 -> 256; llama 192 -> 256), logits are compared on the real V columns, and the engine's log-probs
(padding masked out of the vocab-parallel softmax) against HF log_softmax.
Prints one `RESULT {json}` line per check (TP rank 0 of the last pipeline stage).
"""

from __future__ import annotations

import os
import sys

# models_helpers first: it applies the CPU patches before torch's users and Megatron load.
from tests.integration.megatron.workers import models_helpers as H

# isort: split
import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from transformers import AutoModelForCausalLM

from megatron_sao.checkpoint.converters import get_converter
from megatron_sao.checkpoint.converters.qwen3_moe import unfuse_experts
from megatron_sao.checkpoint.load import load_hf_into_model, load_megatron_checkpoint_into_model
from megatron_sao.checkpoint.sharding import local_to_global_name, unshard_tensor
from megatron_sao.megatron.forward import token_logprobs
from megatron_sao.models.freeze import apply_freeze, critic_frozen_attention_patterns
from megatron_sao.models.gpt import build_gpt_model, transformer_config_from_spec
from megatron_sao.models.hf_config import model_spec_from_hf
from megatron_sao.models.parallel_sizes import ParallelSizes

ARCHS = ("qwen3_moe", "qwen3", "llama")


def build(spec, par: ParallelSizes, role="actor", hf_dir=None, ckpt_dir=None, **kw):
    layout = H.init_parallel(par.tp, par.pp, par.ep, par.etp)
    config = transformer_config_from_spec(spec, par)
    model = build_gpt_model(spec, config, role=role, pre_process=layout.is_first_stage,
                            post_process=layout.is_last_stage, **kw)
    if hf_dir is not None:
        load_hf_into_model([model], hf_dir, spec, layout, role=role)
    if ckpt_dir is not None:
        load_megatron_checkpoint_into_model([model], ckpt_dir, layout)
    return model.eval(), layout


def hf_reference(hf_dir, tokens, labels=None):
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = hf(input_ids=tokens, output_hidden_states=True)
    return hf, out.logits.float(), out.hidden_states[-1].float()


def hf_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The engine's convention: log p(tokens[t] | <t) at position t, 0 at t = 0."""
    lp = torch.log_softmax(logits.float(), dim=-1)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


def check_logits(arch, hf_dir, spec, par: ParallelSizes, case: str, ckpt_dir=None):
    tokens, _, pos = H.batch(spec.vocab_size)
    _, ref, _ = hf_reference(hf_dir, tokens)
    if ckpt_dir is None:
        model, layout = build(spec, par, hf_dir=hf_dir)
    else:
        model, layout = build(spec, par, ckpt_dir=ckpt_dir)
    out = H.forward_only(model, tokens, pos)
    if out is not None:
        padded = H.gather_vocab(out)
        logits = padded[..., :spec.vocab_size]
        # Collective over TP (every TP rank calls it); clones: the vocab-parallel CE works in place.
        lp = token_logprobs(out.clone(), tokens, spec.vocab_size)
        unmasked = token_logprobs(out.clone(), tokens, None)  # the padding left in the softmax
        if layout.tp_rank == 0:
            ref_lp = hf_token_logprobs(ref, tokens)
            H.report(check="logits", arch=arch, case=case, rank=torch.distributed.get_rank(), shape=list(logits.shape),
                     padded_width=padded.shape[-1], max_diff=(logits - ref).abs().max().item(),
                     logprob_diff=(lp - ref_lp).abs().max().item(),
                     unmasked_logprob_diff=(unmasked - ref_lp).abs().max().item())


def check_critic_values(arch, hf_dir, spec, par: ParallelSizes, case: str):
    tokens, _, pos = H.batch(spec.vocab_size)
    _, _, hidden = hf_reference(hf_dir, tokens)
    model, layout = build(spec, par, role="critic", hf_dir=hf_dir, value_head_init="normal")
    out = H.forward_only(model, tokens, pos)
    if out is not None:
        params = dict(model.named_parameters())
        ref = hidden @ params["value_head.weight"].detach().T + params["value_head.bias"].detach()
        if layout.tp_rank == 0:
            H.report(check="critic_values", arch=arch, case=case, shape=list(out.shape),
                     max_diff=(out - ref).abs().max().item())


def check_loss_and_grads(arch, hf_dir, spec):
    tokens, labels, pos = H.batch(spec.vocab_size)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").train()
    model, layout = build(spec, ParallelSizes(), hf_dir=hf_dir)
    model.train()
    # The engine's loss path: log-probs over the real vocabulary (padding masked), not GPTModel's labels=.
    logits = model(tokens, pos, None)
    mlp = token_logprobs(logits, torch.cat([tokens[:, :1], labels[:, :-1]], dim=1), spec.vocab_size)
    mloss = -mlp[:, 1:].mean()
    mloss.backward()
    hlogits = hf(input_ids=tokens).logits.float()[:, :-1]
    hloss = F.cross_entropy(hlogits.reshape(-1, spec.vocab_size), labels[:, :-1].reshape(-1))
    hloss.backward()
    conv = get_converter(spec)
    hf_grads = dict(unfuse_experts({n: p.grad for n, p in hf.named_parameters()}, spec))
    if spec.tie_word_embeddings:
        hf_grads.pop("lm_head.weight", None)  # same tensor as embed_tokens
    worst, worst_name, mapped = 0.0, "", set()
    padding_grad = 0.0
    for name, p in model.named_parameters():
        global_name = local_to_global_name(name, layout, spec)
        grad = unshard_tensor(global_name, [p.grad], spec)  # strips the vocabulary padding rows
        if grad.shape != p.grad.shape:
            padding_grad = max(padding_grad, p.grad[spec.vocab_size:].abs().max().item())
        for hf_name, g in conv.mcore_to_hf(global_name, grad, spec):
            mapped.add(hf_name)
            d = (g - hf_grads[hf_name]).abs().max().item()
            if d > worst:
                worst, worst_name = d, hf_name
    H.report(check="loss_grads", arch=arch, loss_diff=abs(mloss.item() - hloss.item()), grad_max_diff=worst,
             padding_grad=padding_grad,
             worst=worst_name, unmapped_hf_grads=sorted(set(hf_grads) - mapped),
             max_grad=max(g.abs().max().item() for g in hf_grads.values()))


def check_critic_init_and_freeze(arch, spec):
    zero, _ = build(spec, ParallelSizes(), role="critic", value_head_init="zero")
    normal, _ = build(spec, ParallelSizes(), role="critic", value_head_init="normal")
    wz, wn = zero.value_head.weight, normal.value_head.weight
    names = [n for n, _ in normal.named_parameters()]
    report = apply_freeze([normal], critic_frozen_attention_patterns(spec))
    attention = sorted(n for n in names if ".self_attention." in n or n.endswith("input_layernorm.weight"))
    try:
        apply_freeze([zero], ["decoder.layers.*.no_such_param"])
        empty_error = ""
    except ValueError as exc:
        empty_error = str(exc)
    H.report(check="critic_init_freeze", arch=arch, zero_shape=list(wz.shape), zero_all=bool((wz == 0).all()),
             normal_std=wn.std().item(), has_output_layer="output_layer.weight" in names,
             frozen=sorted(report.frozen_names) == attention, n_frozen=len(report.frozen_names),
             frozen_req_grad=any(p.requires_grad for n, p in normal.named_parameters() if n in attention),
             value_head_trainable="value_head.weight" in report.trainable_names,
             frozen_params=report.frozen_params, trainable_params=report.trainable_params, empty_error=empty_error)


def main() -> None:
    root, mode = sys.argv[1], sys.argv[2]
    ckpt_dir = sys.argv[3] if len(sys.argv) > 3 else None
    rank, world = H.init_dist()
    if ckpt_dir is not None:
        par = ParallelSizes() if mode == "single" else ParallelSizes(tp=2, ep=2, etp=1, sequence_parallel=True)
        case = "from_megatron_ckpt_" + ("tp1" if mode == "single" else "tp2_ep2_etp1")
        check_logits("qwen3_moe", os.path.join(root, "qwen3_moe"), model_spec_from_hf(os.path.join(root, "qwen3_moe")),
                     par, case, ckpt_dir=ckpt_dir)
    for arch in ARCHS:
        hf_dir = os.path.join(root, arch)
        spec = model_spec_from_hf(hf_dir)
        if mode == "single":
            check_logits(arch, hf_dir, spec, ParallelSizes(), "tp1")
            check_loss_and_grads(arch, hf_dir, spec)
            check_critic_values(arch, hf_dir, spec, ParallelSizes(), "tp1")
            check_critic_init_and_freeze(arch, spec)
            continue
        cases = {"tp2_sp": ParallelSizes(tp=2, sequence_parallel=True), "pp2": ParallelSizes(pp=2)}
        if spec.is_moe:
            cases["ep2"] = ParallelSizes(ep=2)
            cases["tp2_ep2_etp1"] = ParallelSizes(tp=2, ep=2, etp=1, sequence_parallel=True)
        for case, par in cases.items():
            check_logits(arch, hf_dir, spec, par, case)
        if arch == "qwen3_moe":
            check_critic_values(arch, hf_dir, spec, ParallelSizes(tp=2, sequence_parallel=True), "tp2_sp")
    torch.distributed.barrier()
    if rank == 0:
        print(f"WORKER DONE mode={mode} world={world}", flush=True)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
