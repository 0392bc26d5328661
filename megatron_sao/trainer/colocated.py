"""The colocated placement (``cluster.placement: colocated``): every trainer rank hosts a shard of a
vLLM engine, and generation and training take turns on the same GPUs (``rollout/colocate/cycle.py``
has the order and why); its hooks (``trainer/placement.py``) are the turns.

The preflight (``check_colocated``) runs before the trainer loads anything: a colocated job that cannot
work (no vLLM external launcher, pipeline parallelism, an engine size that does not tile the world, a
GPU layout the memory plan refuses) stops with the config key to change, never after minutes of loading.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path

import torch

from megatron_sao.cluster.layout import max_num_seqs
from megatron_sao.config import ConfigError, SAOConfig
from megatron_sao.distributed.gated import GatedCollectives
from megatron_sao.errors import TrainingStopped
from megatron_sao.trainer import components as C
from megatron_sao.trainer.placement import Placement
from megatron_sao.weights.check import check_tokens
from megatron_sao.weights.push import NoWeightPush
from megatron_sao.weights.sync import check_due


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
            return (f"vLLM's sleep mode is not available on {current_platform.device_name} "
                    f"(the engines could not free the GPU)")
    return None


def colocated_problems(cfg: SAOConfig, world: int, *, check_vllm: bool = True,
                       plan_memory: bool | None = None) -> list[str]:
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


def build_colocated(cfg: SAOConfig, model_dir: Path, ctx):
    """This rank's ColocatedRollout (the engine shard is built by its `start`, after the trainer is offloaded)."""
    from megatron_sao.rollout.colocate.cycle import ColocatedRollout
    from megatron_sao.rollout.colocate.layout import EngineLayout

    layout = EngineLayout(world=ctx.world_size, rollout_tp=cfg.cluster.rollout_tp, rank=ctx.rank)
    seqs = max_num_seqs(cfg, layout.engines)
    ecfg = dataclasses.replace(C.engine_config(cfg, model_dir, seqs), tensor_parallel_size=layout.rollout_tp,
                               enable_sleep_mode=torch.cuda.is_available())

    def make_shard():
        from megatron_sao.rollout.colocate.vllm_shard import VLLMShard

        return VLLMShard(ecfg, layout, max_num_seqs=seqs)
    return ColocatedRollout(layout, make_shard, seed=cfg.run.seed)


class ColocatedPlacement(Placement):
    """Every rank hosts an engine shard; generation and training take turns (rollout/colocate/cycle.py).
    Every hook is collective: all ranks call it, in the same order."""

    def __init__(self, cfg: SAOConfig, model_dir: Path, ctx) -> None:
        super().__init__(cfg)
        self.model_dir, self.ctx, self.rank0 = model_dir, ctx, ctx.rank == 0
        self.collectives = GatedCollectives(ctx)
        self.bucket_bytes = cfg.rollout.weight_sync_bucket_mb << 20
        self.atol = cfg.rollout.weight_sync_check_atol
        self.cycle = None  # this rank's ColocatedRollout, built by start() after the trainer is offloaded
        self.actor, self.models, self.check_tokens = None, [], None

    @property
    def engines(self) -> list:
        return list(self.cycle.engines)

    def start(self, actor, models: list) -> None:
        """Trainer offloaded, this rank's engine shard built, then loaded with the actor's weights
        (resumed or not). vLLM re-seeds the global RNG when it builds; the trainer's stream is kept."""
        from megatron_sao.trainer.run_dir import rng_state, set_rng_state

        self.actor, self.models = actor, models
        self.check_tokens = check_tokens(actor.spec.vocab_size) if self.cfg.rollout.weight_sync_check else None
        self.cycle = build_colocated(self.cfg, self.model_dir, self.ctx)
        rng = rng_state()
        self.cycle.start(actor, models, bucket_bytes=self.bucket_bytes, check_tokens=self.check_tokens,
                         atol=self.atol)
        set_rng_state(rng)

    def wait_for_batch(self, step: int, take, should_stop, timeout_s: float):
        """Every rank serves its engine shard until rank 0 holds the next batch (returned on rank 0),
        the run must stop, or ``timeout_s`` passes."""
        self.collectives.wait_for_rank0("the rollout phase")
        got: dict = {}
        deadline = time.monotonic() + timeout_s

        def until() -> bool:
            if should_stop() or time.monotonic() > deadline:
                return True
            got["batch"] = take(0)
            return got["batch"] is not None
        try:
            self.cycle.serve(until if take is not None else None)
        except RuntimeError as e:
            raise TrainingStopped(f"colocated rollout phase at step {step} failed: {e}; resume from the last "
                                  "checkpoint") from e
        return got.get("batch")

    def before_train(self) -> None:
        self.cycle.before_train(self.models)

    def after_train(self, version: int, train_s: float) -> dict:
        """Trainer offloaded, the actor's weights loaded into every shard, KV cache back."""
        self.cycle.mark_train(train_s, self.models)
        t0 = time.monotonic()
        # rollout.weight_sync_check_every: every rank decides alike, by version (the check is collective)
        checked = self.check_tokens if check_due(version, self.cfg.rollout.weight_sync_check_every) else None
        update = self.cycle.refresh(self.actor, self.models, version=version, bucket_bytes=self.bucket_bytes,
                                    check_tokens=checked, atol=self.atol)
        return {"time/weight_sync_s": time.monotonic() - t0,
                **{f"colocate/update_{k}": v for k, v in update.items() if isinstance(v, (int, float))}}

    def weight_push(self, actor, rollout, collectives) -> NoWeightPush:
        return NoWeightPush()  # after_train loads the new weights into every rank's shard, in-process

    def evaluate(self, rollout, out: Path) -> float | None:
        """Evaluation episodes need the engines: every rank serves until rank 0's evaluation finished."""
        from megatron_sao.trainer.evaluate import eval_loop_config, summarize

        fut = tasks = None
        if self.rank0:
            tasks = C.eval_tasks(self.cfg)
            fut = rollout.driver.submit(rollout.evaluation(tasks, C.env_factory(self.cfg), eval_loop_config(self.cfg)))
        self.collectives.wait_for_rank0("the evaluation phase")
        self.cycle.serve(fut.done if self.rank0 else None, evaluation=True)
        if not self.rank0:
            return None
        return summarize(tasks, fut.result(), out)["accuracy"]

    def end_step(self, step: int, run_dir) -> dict:
        """Rank 0's per-phase figures of the step; every rank's records into colocate_trace.jsonl."""
        phases, records = self.cycle.take_records(step)
        if self.rank0:
            with open(run_dir.path / "colocate_trace.jsonl", "a") as f:
                f.writelines(json.dumps(r, default=str) + "\n" for r in records)
        return phases

    def trainer_resident(self):
        """Checkpoints and the final export read the trainer state: the engine sleeps for them."""
        if self.cycle is None or self.actor.resident():
            return contextlib.nullcontext()
        return self.cycle.trainer_resident(self.models)

    def close(self) -> None:
        if self.cycle is not None:
            self.cycle.close()
            self.cycle = None
