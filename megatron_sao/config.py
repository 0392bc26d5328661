"""Typed configuration: one dataclass per concern, loaded from YAML with dotted overrides.

    cfg = load_config("examples/tiny_cpu.yaml", overrides=["algorithm.critic_steps=1", "run.dir=/tmp/x"])

Every key is checked: an unknown key, a value of the wrong type or an impossible value raises
ConfigError naming the dotted key. Paper defaults (SAO, arXiv:2607.07508) are the dataclass
defaults; `presets` holds the per-domain settings (math, coding) that a YAML selects with
`preset: math`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

import yaml


class ConfigError(ValueError):
    """A configuration problem; the message names the dotted key."""


# ------------------------------------------------------------------------------------- sections


@dataclass
class RunConfig:
    name: str = "sao"
    dir: str = "runs/sao"  # run directory: config snapshot, checkpoints, metrics.jsonl, TensorBoard
    seed: int = 1234
    total_steps: int = 100  # actor steps (critic warm-up steps count separately)
    save_every: int = 50
    eval_every: int = 25
    # A whole evaluation, on rank 0 while the other ranks wait at the Rank0Gate (whose heartbeat keeps
    # them waiting as long as rank 0 lives): past it the evaluation is abandoned and logged, training
    # goes on, and a rollout tier that is really stuck stops the run at the next batch wait.
    eval_timeout_s: float = 3600.0
    tensorboard: bool = True
    console: Literal["rich", "plain", "none"] = "rich"
    max_consecutive_nonfinite: int = 3  # NaN/inf steps in a row before the run stops with a checkpoint


@dataclass
class ModelConfig:
    # An HF directory (config.json + safetensors + tokenizer) or a built-in preset name such as
    # "tiny_qwen3_moe" (random init, own char tokenizer; no download).
    path: str = "tiny_qwen3_moe"
    tokenizer: Optional[str] = None  # defaults to `path`
    # The trainer's models are built in this dtype (models/precision.py). bfloat16: Megatron mixed
    # precision (bf16 weights/activations, fp32 main params, grads and Adam state), what every GPU
    # recipe uses and what TE's fused attention needs. float32 (the default): the CPU demo and CI,
    # where bf16 matmuls are slow. float16 is refused (no loss scaling).
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_seq_len: int = 256


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    # Expert tensor parallel size. None = the one rule trainer, planner and converter share
    # (models/parallel_sizes.default_expert_tp): 1 (experts whole on their EP rank) when ep >= tp, else tp.
    etp: Optional[int] = None
    sequence_parallel: bool = False
    micro_batch_size: int = 8
    # Full activation recompute (long contexts); `sao plan` refuses a config that needs it and lacks it.
    recompute: Literal["none", "full"] = "none"


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    init: Optional[str] = None  # HF dir or megatron checkpoint dir; None = model.path


# The paper's frozen-attention critic as group names (expanded per model in models/freeze.py).
PAPER_CRITIC_FREEZE = ("attention", "embeddings", "router", "norms")


@dataclass
class CriticConfig:
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-6))
    init: Optional[str] = None  # a saved critic (megatron or HF) or None = the actor's HF weights
    # What stays frozen during RL: group names (models/freeze.py CRITIC_FREEZE_GROUPS) or parameter-name
    # patterns. The default is the paper's frozen-attention critic: attention, word embeddings, router
    # and norms frozen, so only the expert (dense: MLP) projections and the value head train.
    # [embeddings, router, norms] is the "attention trained" ablation; [] trains everything.
    freeze: list[str] = field(default_factory=lambda: list(PAPER_CRITIC_FREEZE))


@dataclass
class AlgorithmConfig:
    # sao: critic + skip-observation token GAE + DIS.
    # grpo: the paper's vanilla GRPO baseline: n rollouts per prompt, group baseline, PPO clip with the
    #   ratio against the learner's own log-probs before the update (no staleness correction).
    # grpo_rollout_ratio: GRPO with the PPO clip ratio taken against the rollout log-probs (a partial
    #   staleness correction; what `grpo` meant before).
    # grpo_dis: grpo advantages with the DIS loss.  running_mean: DIS with a running-mean baseline.
    name: Literal["sao", "grpo", "grpo_rollout_ratio", "grpo_dis", "running_mean"] = "sao"
    advantage: Literal["token", "step_avg", "step_last"] = "token"  # token-level GAE or step-level
    gamma: float = 1.0
    critic_lambda: float = 1.0
    policy_alpha: float = 1.5  # lambda_policy = clip(1 - 1/(alpha * l), 0, 1)
    policy_lambda: Optional[float] = None  # a fixed policy lambda instead of the adaptive one
    eps_low: float = 0.3  # DIS keeps 1-eps_low < r < 1+eps_high
    eps_high: float = 5.0
    ppo_clip_low: float = 0.2  # grpo baseline only
    ppo_clip_high: float = 0.28
    critic_steps: int = 2  # K critic optimizer steps per actor step
    critic_warmup_steps: int = 10  # critic-only steps before the actor moves
    group_size: int = 8  # grpo*: rollouts per prompt
    running_mean_window: int = 512  # running_mean: rewards kept in the baseline window
    whiten_advantages: bool = False

    @property
    def uses_critic(self) -> bool:
        return self.name == "sao"

    @property
    def uses_groups(self) -> bool:
        """n rollouts per prompt, trained as whole groups."""
        return self.name in GROUPED_ALGORITHMS

    @property
    def uses_rollout_logprobs(self) -> bool:
        """The policy loss takes its ratio against the log-probs the sampler recorded."""
        return self.name != "grpo"


GROUPED_ALGORITHMS = ("grpo", "grpo_rollout_ratio", "grpo_dis")


@dataclass
class RolloutConfig:
    backend: Literal["hf", "vllm", "vllm_server"] = "hf"
    server_urls: list[str] = field(default_factory=list)  # vllm_server / disaggregated
    concurrency: int = 32  # single-rollout episodes in flight
    max_turns: int = 50
    max_total_tokens: int = 131072
    max_new_tokens_per_turn: int = 8192
    temperature: float = 1.0
    top_p: float = 1.0
    inflight_policy: Literal["keep", "abort"] = "keep"
    weight_sync_bucket_mb: int = 512
    timeout_s: float = 600.0  # every request and collective; a dead engine is reported after this
    gpu_memory_utilization: float = 0.5
    colocate: bool = False  # vLLM on the trainer GPUs with sleep/wake
    # Generate requests in flight per server: what `vllm serve --max-num-seqs` is started with (the launch
    # plan passes the same value to both). None: ceil(concurrency / servers) for vllm_server, else unbounded.
    max_num_seqs: Optional[int] = None
    # How weights reach the engines: nccl (GPU), gloo (CPU: the same transfer-group calls), reload
    # (safetensors bytes; rollout/engines/http_server.py), auto (nccl with CUDA, else gloo; a server: what it offers).
    weight_transport: Literal["auto", "reload", "nccl", "gloo"] = "auto"
    # nccl / gloo: the trainer rank-0 host as the servers see it, and one port per server (set by the
    # launch plan from cluster.weight_sync_port; no defaults, a wrong guess would hang a rendezvous).
    weight_transfer_master_address: str = ""
    weight_transfer_ports: list[int] = field(default_factory=list)
    weight_sync_check: bool = False  # after every update, compare each server's log-probs with the trainer's
    weight_sync_check_atol: float = 1e-3
    health_check_interval_s: float = 10.0  # servers failing it stop getting episodes (theirs re-run elsewhere)
    vllm_serve_args: list[str] = field(default_factory=list)  # extra `vllm serve` flags of the launch plan


@dataclass
class EnvConfig:
    name: str = "toy_tool"  # toy_tool | math_python | coding | style_shift
    train_data: Optional[str] = None  # jsonl (or generator spec for toy_tool)
    eval_data: Optional[str] = None
    eval_size: int = 200
    # Generated envs: seed of the held-out tasks (None = run.seed + 100003). Fix it to compare runs
    # of different seeds on the same tasks.
    eval_seed: Optional[int] = None
    kwargs: dict[str, Any] = field(default_factory=dict)  # environment constructor arguments
    task_kwargs: dict[str, Any] = field(default_factory=dict)  # task loader arguments (n, max_ops, data_dir...)
    # Where user namespaces are unavailable (non-root), model code can only run as the trainer's own
    # uid with seccomp, rlimits and audit hooks (envs/sandbox.py, process mode); refused unless true.
    sandbox_allow_same_uid: bool = False


@dataclass
class BufferConfig:
    batch_size: int = 128  # trajectories per actor step (single rollout: = prompts per step)
    # Admission control starts an episode at most max_staleness steps before the batch it is meant
    # for, so this bounds how far rollouts run ahead. A trajectory that still arrives staler (a long
    # episode) is handled by staleness_policy: keep trains on it and DIS masks the drifted tokens
    # (the paper: every finished trajectory is trained on); drop deletes it and re-runs its prompt,
    # at most max_stale_drops times, after which the prompt's next trajectory is trained on anyway.
    max_staleness: int = 4  # max policy-version lag of any action token
    staleness_policy: Literal["drop", "keep"] = "keep"
    max_stale_drops: int = 2


@dataclass
class TrainerConfig:
    mode: Literal["async", "sync"] = "async"
    # Train on the trajectories of a saved file (megatron_sao.trajectory format) instead of live
    # rollouts, in file order: deterministic batches for debugging, regression and parity tests.
    replay: Optional[str] = None
    # Staleness stress test (CPU only): the rollout engine always holds the policy of `policy_lag`
    # actor steps ago. The trainer keeps policy_lag + 1 full CPU copies of the weights for it (model
    # size x (lag + 1) of host memory), so it is refused for bf16/fp16 models and cluster placements.
    # With `mode: sync` every trajectory is then exactly `policy_lag` versions old.
    policy_lag: int = 0


@dataclass
class SFTConfig:
    data: Optional[str] = None  # jsonl of {"messages": [...]}; None = the env's demonstration generator
    steps: int = 1000
    batch_size: int = 64
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 20
    demonstrations: int = 20000  # generated demonstrations (toy_tool)
    error_rate: float = 0.3  # fraction of generated demonstrations with a mistake in them
    eval: bool = True  # evaluate the SFT model (the RL starting point) at the end


@dataclass
class ValuePretrainConfig:
    rollouts: int = 512  # trajectories of the fixed SFT policy to fit on
    steps: int = 50  # critic optimizer steps
    batch_size: int = 64
    lr: Optional[float] = None  # default: critic.optim.lr
    freeze_attention: bool = False  # the paper freezes attention during RL; pretraining fits it all


@dataclass
class ClusterConfig:
    # embedded: everything on one machine (CPU demo); colocated: vLLM shares the trainer GPUs with
    # sleep/wake; disaggregated: vLLM servers on their own nodes, weights over NCCL.
    placement: Literal["embedded", "colocated", "disaggregated"] = "embedded"
    trainer_nodes: int = 1
    rollout_nodes: int = 0
    gpus_per_node: int = 8
    rollout_tp: int = 1  # vLLM tensor parallel size of one server
    rollout_port: int = 8000
    master_port: int = 29500
    weight_sync_port: int = 29600  # server i's weight-transfer group: port weight_sync_port + i on trainer rank 0
    gpu_memory_gib: float = 80.0  # per-GPU memory the planner budgets against


@dataclass
class SAOConfig:
    preset: Optional[str] = None
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    value_pretrain: ValuePretrainConfig = field(default_factory=ValuePretrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


# ------------------------------------------------------------------------------------- presets

PRESETS: dict[str, dict[str, Any]] = {
    # Paper settings for reasoning with a Python tool (AIME): DIS band 0.7..6.0.
    "math": {"algorithm": {"eps_low": 0.3, "eps_high": 5.0, "critic_steps": 2, "critic_warmup_steps": 10,
                           "policy_alpha": 1.5, "critic_lambda": 1.0, "gamma": 1.0},
             "actor": {"optim": {"lr": 1e-6}}, "critic": {"optim": {"lr": 5e-6}},
             "buffer": {"batch_size": 128},
             "rollout": {"max_total_tokens": 131072, "max_turns": 50, "temperature": 1.0, "top_p": 1.0},
             "env": {"name": "math_python"}},
    # Paper settings for coding (SWE): DIS band 0.2..4.0.
    "coding": {"algorithm": {"eps_low": 0.8, "eps_high": 3.0, "critic_steps": 2, "critic_warmup_steps": 10,
                             "policy_alpha": 1.5, "critic_lambda": 1.0, "gamma": 1.0},
               "actor": {"optim": {"lr": 1e-6}}, "critic": {"optim": {"lr": 5e-6}},
               "buffer": {"batch_size": 128},
               "rollout": {"max_total_tokens": 131072, "max_turns": 300},
               "env": {"name": "coding"}},
}


# ------------------------------------------------------------------------------------- validation


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def validate(cfg: SAOConfig) -> SAOConfig:
    a, p, r, b = cfg.algorithm, cfg.parallel, cfg.rollout, cfg.buffer
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
    if a.uses_groups:
        _check(a.group_size >= 2, "algorithm.group_size", f"{a.name} needs at least 2 rollouts per prompt")
        _check(b.batch_size % a.group_size == 0, "buffer.batch_size",
               f"must be a multiple of algorithm.group_size ({a.group_size}) for {a.name}")
    if a.advantage != "token":
        _check(a.name == "sao", "algorithm.advantage", "step-level GAE needs the critic (algorithm.name: sao)")
    for k in ("tp", "pp", "ep", "micro_batch_size"):
        _check(getattr(p, k) >= 1, f"parallel.{k}", f"must be >= 1, got {getattr(p, k)}")
    if p.etp is not None:
        _check(p.etp >= 1, "parallel.etp", f"must be >= 1 (or unset), got {p.etp}")
    _check(cfg.model.dtype != "float16", "model.dtype",
           "float16 training needs loss scaling, which the trainer does not implement; use bfloat16")
    _check(not p.sequence_parallel or p.tp > 1, "parallel.sequence_parallel", "needs parallel.tp > 1")
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
    _check(r.timeout_s > 0, "rollout.timeout_s", "must be > 0")
    if r.backend == "vllm_server":
        _check(bool(r.server_urls), "rollout.server_urls", "backend vllm_server needs at least one url")
        _check(len(set(r.server_urls)) == len(r.server_urls), "rollout.server_urls", f"has duplicates: {r.server_urls}")
    if r.max_num_seqs is not None:
        _check(r.max_num_seqs >= 1, "rollout.max_num_seqs", f"must be >= 1, got {r.max_num_seqs}")
    if r.weight_transfer_ports:
        n = len(r.server_urls) if r.backend == "vllm_server" else 1
        _check(len(r.weight_transfer_ports) == n, "rollout.weight_transfer_ports",
               f"needs one port per server ({n}), got {r.weight_transfer_ports}")
        _check(len(set(r.weight_transfer_ports)) == len(r.weight_transfer_ports), "rollout.weight_transfer_ports",
               f"must be distinct (one transfer group per server), got {r.weight_transfer_ports}")
        _check(all(0 < p < 65536 for p in r.weight_transfer_ports), "rollout.weight_transfer_ports",
               f"must be TCP ports, got {r.weight_transfer_ports}")
        _check(bool(r.weight_transfer_master_address), "rollout.weight_transfer_master_address",
               "is required with rollout.weight_transfer_ports (the trainer rank-0 host)")
    _check(r.weight_sync_check_atol > 0, "rollout.weight_sync_check_atol", "must be > 0")
    _check(r.health_check_interval_s >= 0, "rollout.health_check_interval_s", "must be >= 0 (0 = off)")
    _check(b.batch_size >= 1, "buffer.batch_size", "must be >= 1")
    _check(b.max_staleness >= 0, "buffer.max_staleness", "must be >= 0")
    _check(b.max_stale_drops >= 0, "buffer.max_stale_drops", f"must be >= 0, got {b.max_stale_drops}")
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
    _check(cfg.run.total_steps >= 0, "run.total_steps", "must be >= 0")
    for k in ("save_every", "eval_every"):
        _check(getattr(cfg.run, k) >= 0, f"run.{k}", "must be >= 0")
    _check(cfg.run.eval_timeout_s > 0, "run.eval_timeout_s", "must be > 0")
    for role in ("actor", "critic"):
        o = getattr(cfg, role).optim
        _check(o.lr >= 0, f"{role}.optim.lr", f"must be >= 0, got {o.lr}")
        _check(o.clip_grad >= 0, f"{role}.optim.clip_grad", "must be >= 0")
    _check(cfg.model.max_seq_len >= 2, "model.max_seq_len", "must be >= 2")
    _check(0 <= cfg.sft.error_rate <= 1, "sft.error_rate", "must be in [0, 1]")
    if cfg.preset is not None:
        _check(cfg.preset in PRESETS, "preset", f"unknown preset {cfg.preset!r}; known: {sorted(PRESETS)}")
    return cfg


# ------------------------------------------------------------------------------------- loading


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for t in args:
            if t is type(None):
                continue
            try:
                return _coerce(value, t, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: cannot be None")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
        return _from_dict(tp, value, key)
    if origin in (list, Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `2e-4` (no dot) as a string; accept what float() reads
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {tp}")


class RemovedConfigKey(UserWarning):
    """A key the schema no longer has was given; it is ignored (the message names it)."""


# Keys that were validated but never read; old configs and run snapshots still carry them.
REMOVED_KEYS: dict[str, str] = {
    "run.log_every": "metrics are logged every step",
    "critic.value_head_init": "a critic without a saved value head starts from N(0, init_std); for a zero "
                              "head convert with `sao convert hf-to-megatron --role critic --value-head-init zero`",
    "buffer.max_pending": "admission control (buffer.max_staleness) bounds the finished trajectories held",
    "trainer.global_batch_tokens": "micro-batches are parallel.micro_batch_size rows",
}


def _drop_removed_keys(data: dict, prefix: str) -> dict:
    import warnings

    out = dict(data)
    for k in list(out):
        key = f"{prefix}.{k}" if prefix else k
        if key in REMOVED_KEYS:
            del out[k]
            warnings.warn(f"{key}: removed from the config schema and ignored ({REMOVED_KEYS[key]})",
                          RemovedConfigKey, stacklevel=2)
    return out


def _from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    data = _drop_removed_keys(data, prefix)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = prefix or "top level"
        raise ConfigError(f"{prefix + '.' if prefix else ''}{unknown[0]}: unknown key at {where} "
                          f"(known: {sorted(names)})")
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else k
        kwargs[k] = _coerce(v, hints[k], key)
    # Nested sections not given keep their defaults but must still be dataclass instances.
    obj = cls(**kwargs)
    return obj


def _deep_merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _merge_into_defaults(cls: type, data: dict) -> dict:
    """Fill nested sections so that a partial section keeps the other defaults of that section."""
    defaults = to_dict(cls())
    return _deep_merge(defaults, data)


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key.path=value")
    key, raw = item.split("=", 1)
    key = key.strip().lstrip("-")
    if not key:
        raise ConfigError(f"override {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {key}: cannot parse value {raw!r}: {e}") from e
    return key.split("."), value


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    data = _deep_merge({}, data)
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for i, part in enumerate(path[:-1]):
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"{'.'.join(path[:i + 1])}: is a value, cannot set {'.'.join(path)}")
            node = nxt
        node[path[-1]] = value
    return data


def config_from_dict(data: dict, overrides: Sequence[str] = ()) -> SAOConfig:
    data = apply_overrides(data or {}, overrides)
    preset = data.get("preset")
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"preset: unknown preset {preset!r}; known: {sorted(PRESETS)}")
        # The preset sits between the defaults and the file: the file (and overrides) win.
        data = _deep_merge(PRESETS[preset], data)
    data = _merge_into_defaults(SAOConfig, data)
    return validate(_from_dict(SAOConfig, data))


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> SAOConfig:
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: invalid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: top level must be a mapping")
    return config_from_dict(data, overrides)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def dump_config(cfg: SAOConfig, path: str | Path) -> None:
    """Write the resolved config (the run's snapshot) atomically."""
    p = Path(path)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    tmp.replace(p)
