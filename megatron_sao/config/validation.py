"""Checks of a typed config beyond its types: impossible values and combinations.

Each problem raises ConfigError naming the dotted key. The checks run in a fixed order and stop at
the first failure, so a config with several problems always reports the same one.
"""

from __future__ import annotations

import math

from megatron_sao.config.errors import ConfigError
from megatron_sao.config.presets import PRESETS
from megatron_sao.config.schema import (
    AlgorithmConfig,
    BufferConfig,
    ModelConfig,
    ParallelConfig,
    RolloutConfig,
    RunConfig,
    SAOConfig,
)


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def _check_algorithm(a: AlgorithmConfig, b: BufferConfig) -> None:
    """The algorithm's coefficients, and the groups it trains on."""
    _check(0 < a.eps_low < 1, "algorithm.eps_low", f"must be in (0, 1), got {a.eps_low}")
    _check(a.eps_high > 0, "algorithm.eps_high", f"must be > 0, got {a.eps_high}")
    _check(0 <= a.gamma <= 1, "algorithm.gamma", f"must be in [0, 1], got {a.gamma}")
    _check(0 <= a.critic_lambda <= 1, "algorithm.critic_lambda", f"must be in [0, 1], got {a.critic_lambda}")
    _check(a.policy_alpha > 0, "algorithm.policy_alpha", f"must be > 0, got {a.policy_alpha}")
    if a.policy_lambda is not None:
        _check(0 <= a.policy_lambda <= 1, "algorithm.policy_lambda", f"must be in [0, 1], got {a.policy_lambda}")
    _check(a.critic_steps >= 1, "algorithm.critic_steps", f"must be >= 1, got {a.critic_steps}")
    _check(a.critic_warmup_steps >= 0, "algorithm.critic_warmup_steps", "must be >= 0")
    _check(a.group_size >= 1, "algorithm.group_size", "must be >= 1")
    _check(math.isfinite(a.entropy_coef) and a.entropy_coef >= 0, "algorithm.entropy_coef",
           f"must be >= 0, got {a.entropy_coef}")
    if a.uses_groups:
        _check(a.group_size >= 2, "algorithm.group_size", f"{a.name} needs at least 2 rollouts per prompt")
        _check(b.batch_size % a.group_size == 0, "buffer.batch_size",
               f"must be a multiple of algorithm.group_size ({a.group_size}) for {a.name}")
    if a.advantage != "token":
        _check(a.name == "sao", "algorithm.advantage", "step-level GAE needs the critic (algorithm.name: sao)")


def _check_model_layout(p: ParallelConfig, model: ModelConfig) -> None:
    """How the trainer builds its models: parallel sizes, dtype, sequence parallel."""
    for k in ("tp", "pp", "ep", "micro_batch_size"):
        _check(getattr(p, k) >= 1, f"parallel.{k}", f"must be >= 1, got {getattr(p, k)}")
    if p.etp is not None:
        _check(p.etp >= 1, "parallel.etp", f"must be >= 1 (or unset), got {p.etp}")
    _check(model.dtype != "float16", "model.dtype",
           "float16 training needs loss scaling, which the trainer does not implement; use bfloat16")
    _check(not p.sequence_parallel or p.tp > 1, "parallel.sequence_parallel", "needs parallel.tp > 1")
    if p.max_tokens_per_micro_batch is not None:
        # (Under sequence parallel a row is padded to a multiple of tp; the engine's plan refuses a
        # budget below that width with the same key, after the layout rules have had their say.)
        _check(p.max_tokens_per_micro_batch >= model.max_seq_len, "parallel.max_tokens_per_micro_batch",
               f"must hold one whole row of model.max_seq_len={model.max_seq_len} tokens, "
               f"got {p.max_tokens_per_micro_batch}")


def _check_sampling(r: RolloutConfig, a: AlgorithmConfig) -> None:
    """Episode sizes and sampling settings, which the algorithm's loss may pin."""
    _check(r.concurrency >= 1, "rollout.concurrency", "must be >= 1")
    _check(r.max_turns >= 1, "rollout.max_turns", "must be >= 1")
    _check(r.max_new_tokens_per_turn >= 1, "rollout.max_new_tokens_per_turn", "must be >= 1")
    _check(r.max_total_tokens >= 2, "rollout.max_total_tokens", f"must be >= 2, got {r.max_total_tokens}")
    _check(r.temperature > 0, "rollout.temperature", f"must be > 0, got {r.temperature}")
    _check(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    if a.uses_rollout_logprobs:
        # The learner's log-probs come from the raw logits; the sampler's would describe the
        # tempered / truncated distribution, and the importance ratio would mask tokens at lag 0.
        # (Evaluation samples with its own fixed settings and trains nothing.)
        for key, value, neutral in (("temperature", r.temperature, 1.0), ("top_p", r.top_p, 1.0)):
            _check(value == neutral, f"rollout.{key}",
                   f"must be {neutral} for algorithm.name={a.name}: its loss compares the learner's log-probs "
                   f"(raw logits) with the rollout log-probs, which {key}={value} would change; only "
                   f"algorithm.name=grpo (ratio against its own log-probs) samples with other settings")


def _check_rollout_servers(r: RolloutConfig, placement: str) -> None:
    """Requests, the server pool and weight sync."""
    _check(r.timeout_s > 0, "rollout.timeout_s", "must be > 0")
    if r.backend == "vllm_server":
        _check(bool(r.server_urls), "rollout.server_urls", "backend vllm_server needs at least one url")
        _check(len(set(r.server_urls)) == len(r.server_urls), "rollout.server_urls", f"has duplicates: {r.server_urls}")
    if r.backend == "vllm" and placement == "embedded":  # disaggregated: vllm serve on other GPUs, NCCL is right
        _check(r.weight_transport != "nccl", "rollout.weight_transport",
               "nccl cannot reach the embedded rollout.backend vllm engine: its worker runs on trainer rank 0's "
               "own GPU, and NCCL refuses a group with two ranks on one device; leave it auto (CUDA IPC on a "
               "GPU, the gloo group on CPU)")
    if r.max_num_seqs is not None:
        _check(r.max_num_seqs >= 1, "rollout.max_num_seqs", f"must be >= 1, got {r.max_num_seqs}")
    if r.weight_transfer_ports:
        n = len(r.server_urls) if r.backend == "vllm_server" else 1
        _check(len(r.weight_transfer_ports) == n, "rollout.weight_transfer_ports",
               f"needs one port per server ({n}), got {r.weight_transfer_ports}")
        _check(len(set(r.weight_transfer_ports)) == len(r.weight_transfer_ports), "rollout.weight_transfer_ports",
               f"must be distinct (one rendezvous port per server), got {r.weight_transfer_ports}")
        _check(all(0 < p < 65536 for p in r.weight_transfer_ports), "rollout.weight_transfer_ports",
               f"must be TCP ports, got {r.weight_transfer_ports}")
        _check(bool(r.weight_transfer_master_address), "rollout.weight_transfer_master_address",
               "is required with rollout.weight_transfer_ports (the trainer rank-0 host)")
    _check(r.weight_sync_check_atol > 0, "rollout.weight_sync_check_atol", "must be > 0")
    _check(isinstance(r.weight_sync_check_every, int) and r.weight_sync_check_every >= 1,
           "rollout.weight_sync_check_every", f"must be an int >= 1, got {r.weight_sync_check_every!r}")
    _check(r.health_check_interval_s >= 0, "rollout.health_check_interval_s", "must be >= 0 (0 = off)")
    _check(r.server_deadline_s >= 0, "rollout.server_deadline_s", "must be >= 0 (0 = stop when the last server dies)")
    _check(r.server_start_timeout_s > 0, "rollout.server_start_timeout_s", "must be > 0")
    _check(r.rejoin_attempts >= 1, "rollout.rejoin_attempts", "must be >= 1 (1: one failed rejoin leaves it out)")
    _check(r.start_min_servers >= 0, "rollout.start_min_servers", "must be >= 0 (0 = every server)")
    if r.backend == "vllm_server" and r.server_urls:
        _check(r.start_min_servers <= len(r.server_urls), "rollout.start_min_servers",
               f"is {r.start_min_servers} but rollout.server_urls names {len(r.server_urls)} servers")


def _check_colocated_routes(cfg: SAOConfig) -> None:
    """Routes from colocated engine shards need rollout_tp 1 (vLLM 0.33, found by reading it: no GPU run
    yet). vLLM returns a request's routed experts from the routed-experts capture of the first TP worker
    only, and in the colocated placement every trainer rank drives its own shard's scheduler in
    lockstep (the external launcher): the shards of the other TP ranks get outputs with no routes, and
    the scheduler's routed-experts step asserts on them. So the AIME colocated recipe (rollout_tp 4)
    cannot replay routes; the disaggregated placement (`vllm serve`, one scheduler per server) can."""
    r, c = cfg.rollout, cfg.cluster
    if c.placement != "colocated" or cfg.trainer.replay or not r.returns_routes or c.rollout_tp == 1:
        return
    key = "rollout.routing_replay" if r.routing_replay else "rollout.record_routes"
    raise ConfigError(f"{key}: the colocated placement cannot return routes with cluster.rollout_tp="
                      f"{c.rollout_tp}: vLLM keeps a request's routed experts on the first TP worker only, and "
                      "every colocated rank runs its shard's scheduler, which fails on the others' empty routes; "
                      "use cluster.rollout_tp 1, the disaggregated placement, or turn routes off")


def _check_buffer(b: BufferConfig) -> None:
    _check(b.batch_size >= 1, "buffer.batch_size", "must be >= 1")
    _check(b.max_staleness >= 0, "buffer.max_staleness", "must be >= 0")
    _check(b.max_stale_drops >= 0, "buffer.max_stale_drops", f"must be >= 0, got {b.max_stale_drops}")


def _check_policy_lag(cfg: SAOConfig) -> None:
    """trainer.policy_lag, the CPU staleness stress test, and what it rules out."""
    b = cfg.buffer
    lag = cfg.trainer.policy_lag
    _check(lag >= 0, "trainer.policy_lag", f"must be >= 0, got {lag}")
    if lag:
        # The stress test keeps `lag` full copies of the weights in host memory (by design, see
        # trainer.policy_lag): fine for the CPU demo's models, never for a GPU-sized one.
        _check(cfg.model.dtype == "float32" and cfg.cluster.placement == "embedded", "trainer.policy_lag",
               "is a CPU staleness test (it holds policy_lag full copies of the model in host memory); "
               f"it needs model.dtype float32 and cluster.placement embedded, got {cfg.model.dtype} / "
               f"{cfg.cluster.placement}")
        _check(not cfg.rollout.weight_sync_check, "rollout.weight_sync_check",
               "cannot check the lagged weights of trainer.policy_lag against the current actor")
    if lag and b.staleness_policy == "drop":
        _check(b.max_staleness >= lag, "buffer.max_staleness",
               f"must be >= trainer.policy_lag ({lag}) with staleness_policy drop, or every trajectory is dropped")


def _check_run(run: RunConfig) -> None:
    _check(run.total_steps >= 0, "run.total_steps", "must be >= 0")
    for k in ("save_every", "eval_every", "export_every"):
        _check(getattr(run, k) >= 0, f"run.{k}", "must be >= 0")
    _check(run.eval_timeout_s > 0, "run.eval_timeout_s", "must be > 0")
    _check(all(s >= 1 for s in run.eval_at), "run.eval_at",
           f"must list trainer steps >= 1, got {run.eval_at}")
    if run.wandb.project is not None:
        _check(bool(run.wandb.project.strip()), "run.wandb.project", "must be a non-empty name (or null: W&B off)")


def _check_harness_env(cfg: SAOConfig) -> None:
    """An environment that runs an agent harness (``swe``): its deadlines, and what its segments rule out."""
    if cfg.env.name != "swe":
        return
    from megatron_sao.envs.swe.env import SWEEnv

    try:
        env = SWEEnv.limits_of(cfg.env.kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"env.kwargs: {e}") from None
    budget = env["wall_limit_s"] + env["grade_timeout_s"]
    _check(budget < cfg.rollout.timeout_s, "env.kwargs.wall_limit_s",
           f"the episode's wall limit ({env['wall_limit_s']:g} s) plus its grading (env.kwargs.grade_timeout_s, "
           f"{env['grade_timeout_s']:g} s) must end before rollout.timeout_s ({cfg.rollout.timeout_s:g} s): the "
           "trainer stops waiting for trajectories after that long")
    # A harness may rewrite its history, which splits an episode into several trajectories (segments,
    # rollout/agent_endpoint/session.py); a group baseline counts trajectories per prompt as its rollouts.
    _check(not cfg.algorithm.uses_groups, "algorithm.name",
           f"{cfg.algorithm.name} counts the trajectories of a prompt as its group's rollouts, but an episode of "
           "env swe may be several trajectories (a rewritten history starts a segment); use sao or "
           "running_mean")


def _check_optimizers(cfg: SAOConfig) -> None:
    for role in ("actor", "critic"):
        o = getattr(cfg, role).optim
        _check(o.lr >= 0, f"{role}.optim.lr", f"must be >= 0, got {o.lr}")
        _check(o.clip_grad >= 0, f"{role}.optim.clip_grad", "must be >= 0")


def _check_critic(cfg: SAOConfig) -> None:
    v = cfg.value_pretrain
    for key, lr, default in (("critic.value_head_lr", cfg.critic.value_head_lr, "critic.optim.lr"),
                             ("value_pretrain.value_head_lr", v.value_head_lr, "critic.value_head_lr")):
        if lr is not None:
            _check(lr > 0, key, f"must be > 0 (or null: {default}), got {lr}")
    _check(v.rollouts >= 2, "value_pretrain.rollouts",
           f"must be >= 2 (a training and a held-out split), got {v.rollouts}")
    _check(0 < v.heldout_fraction < 1, "value_pretrain.heldout_fraction",
           f"must be in (0, 1), got {v.heldout_fraction}")
    _check(v.steps >= 1, "value_pretrain.steps", f"must be >= 1, got {v.steps}")
    _check(v.batch_size >= 1, "value_pretrain.batch_size", f"must be >= 1, got {v.batch_size}")
    _check(v.eval_every >= 1, "value_pretrain.eval_every", f"must be >= 1, got {v.eval_every}")
    _check(v.patience >= 0, "value_pretrain.patience", f"must be >= 0 (0: no early stop), got {v.patience}")
    _check(v.min_delta >= 0, "value_pretrain.min_delta", f"must be >= 0, got {v.min_delta}")
    if v.lr is not None:
        _check(v.lr > 0, "value_pretrain.lr", f"must be > 0 (or null: critic.optim.lr), got {v.lr}")


def validate(cfg: SAOConfig) -> SAOConfig:
    _check_algorithm(cfg.algorithm, cfg.buffer)
    _check_model_layout(cfg.parallel, cfg.model)
    _check_sampling(cfg.rollout, cfg.algorithm)
    _check_rollout_servers(cfg.rollout, cfg.cluster.placement)
    _check_colocated_routes(cfg)
    _check_buffer(cfg.buffer)
    _check_policy_lag(cfg)
    _check_run(cfg.run)
    steps = cfg.run.total_steps + cfg.algorithm.warmup_steps
    _check(all(s <= steps for s in cfg.run.eval_at), "run.eval_at",
           f"names steps past the run's last trainer step {steps} (run.total_steps plus the critic warm-up): "
           f"{[s for s in cfg.run.eval_at if s > steps]}")
    _check_optimizers(cfg)
    _check_critic(cfg)
    _check_harness_env(cfg)
    _check(cfg.model.max_seq_len >= 2, "model.max_seq_len", "must be >= 2")
    _check(0 <= cfg.sft.error_rate <= 1, "sft.error_rate", "must be in [0, 1]")
    if cfg.preset is not None:
        _check(cfg.preset in PRESETS, "preset", f"unknown preset {cfg.preset!r}; known: {sorted(PRESETS)}")
    return cfg
