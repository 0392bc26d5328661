"""The typed config tree: one dataclass per section of the YAML, `SAOConfig` at the top.

The dataclass defaults are the paper's (SAO, arXiv:2607.07508); the field names are the YAML keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal, Optional

from megatron_sao.rollout.engines.kinds import Backend, InflightPolicy
from megatron_sao.weights.buckets import WeightTransportName


@dataclass
class WandbConfig:
    """`run.wandb`: Weights & Biases beside TensorBoard, the same scalars (trainer/scalar_sinks.py)."""

    project: Optional[str] = None  # None: W&B off
    entity: Optional[str] = None  # team or user; None: W&B's default entity
    mode: Literal["online", "offline", "disabled"] = "online"  # offline: files only, `wandb sync` later


@dataclass
class RunConfig:
    name: str = "sao"
    dir: str = "runs/sao"  # run directory: config snapshot, checkpoints, metrics.jsonl, TensorBoard
    seed: int = 1234
    total_steps: int = 100  # actor steps (critic warm-up steps count separately)
    save_every: int = 50
    # Checkpoints written while training goes on (megatron/async_saves.py): the trainer waits only while the
    # shards are planned and snapshotted, writer processes do the rest; the next save and the run's end wait
    # for the previous one. false: every rank writes before the next step (the blocked seconds of each save
    # are in metrics.jsonl either way, checkpoint/blocked_s).
    async_save: bool = True
    eval_every: int = 25  # trainer steps (critic warm-up included) between held-out evaluations; 0: none
    # Trainer steps after which the held-out evaluation runs as well (a comparison that evaluates every
    # method at the same trajectory counts: benchmarks/reproduce/smollm2_main.py).
    eval_at: list[int] = field(default_factory=list)
    # A whole evaluation, on rank 0 while the other ranks wait at the Rank0Gate (whose heartbeat keeps
    # them waiting as long as rank 0 lives): past it the evaluation is abandoned and logged, training
    # goes on, and a rollout tier that is really stuck stops the run at the next batch wait.
    eval_timeout_s: float = 3600.0
    tensorboard: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # An HF checkpoint of the actor every N steps into <run>/exports/step_N (0: off), kept like the
    # checkpoints (the newest two), for evaluating mid-run with one's own tools.
    export_every: int = 0
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
    # A micro-batch holds at most micro_batch_size rows and, when max_tokens_per_micro_batch is set, at
    # most that many padded tokens (rows x its longest row's width): long rows go alone, short ones
    # many together. Unset: micro-batches of micro_batch_size rows. Rows go to DP ranks by a partition
    # of their compute cost either way (megatron/batching.py); the budget must hold a model.max_seq_len
    # row, and `sao plan` counts the activations and logits of a budget-sized micro-batch.
    micro_batch_size: int = 8
    max_tokens_per_micro_batch: Optional[int] = None
    # Full activation recompute (long contexts); `sao plan` refuses a config that needs it and lacks it.
    recompute: Literal["none", "full"] = "none"


@dataclass
class OptimSection:
    """`actor.optim` / `critic.optim`: what a user sets. The engine's own optimizer settings are
    megatron/optimizer.OptimConfig, built from this by trainer/components.engine_optim."""

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
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=1e-6))
    init: Optional[str] = None  # HF dir or megatron checkpoint dir; None = model.path


# The paper's frozen-attention critic as group names (expanded per model in models/freeze.py).
PAPER_CRITIC_FREEZE = ("attention", "embeddings", "router", "norms")


@dataclass
class CriticConfig:
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=5e-6))
    init: Optional[str] = None  # a saved critic (megatron or HF) or None = the actor's HF weights
    # What stays frozen during RL: group names (models/freeze.py CRITIC_FREEZE_GROUPS) or parameter-name
    # patterns. The default is the paper's frozen-attention critic: attention, word embeddings, router
    # and norms frozen, so only the expert (dense: MLP) projections and the value head train.
    # [embeddings, router, norms] is the "attention trained" ablation; [] trains everything.
    freeze: list[str] = field(default_factory=lambda: list(PAPER_CRITIC_FREEZE))
    # The value head of a critic that starts from a policy checkpoint (no saved head). zero: weight 0, so
    # the critic starts as a constant (explained variance exactly 0); normal: N(0, 0.02), which on
    # final-norm hidden states of norm ~50 starts with values of std ~1 and EV far below 0 (SmolLM2: -3.5).
    value_head_init: Literal["zero", "normal"] = "zero"
    # That fresh head's bias: 0, or the token-mean return of the first data it is fitted on (value
    # pretraining's training split; the first warm-up batch of `sao train`), the best constant value.
    value_head_bias: Literal["zero", "mean_return"] = "mean_return"
    # Learning rate of the value head (weight and bias) alone; None: critic.optim.lr. A [1, H] head under
    # Adam moves each weight by about lr per step whatever its gradient, so at the backbone's LR it
    # cannot follow the returns within a run; a higher one lets a fresh head fit in a few steps.
    value_head_lr: Optional[float] = None


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
    # Entropy bonus: the policy loss minus entropy_coef x the token-mean entropy of the sampled
    # tokens' distributions (algorithms.losses.entropy_bonus; verl's entropy_coeff). 0 = the paper's loss.
    entropy_coef: float = 0.0

    @property
    def uses_critic(self) -> bool:
        return self.name == "sao"

    @property
    def warmup_steps(self) -> int:
        """The critic-only trainer steps this algorithm runs before the actor moves (none without a critic)."""
        return self.critic_warmup_steps if self.uses_critic else 0

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
class AgentEndpointConfig:
    """`rollout.agent_endpoint`: the OpenAI-compatible endpoint a harness environment's agent (mini-swe-agent
    in `swe`) reaches the policy through (rollout/agent_endpoint/, docs/agent_harness.md). On whenever the
    environment runs a harness."""

    host: str = "127.0.0.1"  # where it listens; 0.0.0.0 for harnesses on other machines
    port: int = 0  # 0: any free port (the harness is given the URL)
    # The host name harnesses use to reach it (a cluster's node name); "" = `host`.
    public_host: str = ""
    model_name: str = "policy"  # what /v1/models lists and requests name
    # Write every assistant turn as the engine returned it (ids, log-probs, versions) to
    # <run>/agent_turns.jsonl, to audit trajectories against (one line per turn: large for long runs).
    log_turns: bool = False


@dataclass
class RolloutConfig:
    backend: Backend = "hf"
    server_urls: list[str] = field(default_factory=list)  # vllm_server / disaggregated
    concurrency: int = 32  # single-rollout episodes in flight
    max_turns: int = 50
    max_total_tokens: int = 131072
    max_new_tokens_per_turn: int = 8192
    temperature: float = 1.0
    top_p: float = 1.0
    inflight_policy: InflightPolicy = "keep"
    weight_sync_bucket_mb: int = 512
    timeout_s: float = 600.0  # every request and collective; a dead engine is reported after this
    gpu_memory_utilization: float = 0.5
    colocate: bool = False  # vLLM on the trainer GPUs with sleep/wake
    # Generate requests in flight per server: what `vllm serve --max-num-seqs` is started with (the launch
    # plan passes the same value to both). None: ceil(concurrency / servers) for vllm_server, else unbounded.
    max_num_seqs: Optional[int] = None
    # How weights reach the engines: nccl (GPU servers), gloo (CPU: the same transfer-group calls), reload
    # (safetensors bytes; rollout/engines/http_server.py), auto (servers: nccl with CUDA, else gloo, or what a
    # server offers; backend vllm: CUDA IPC with CUDA, else gloo; nccl is refused for backend vllm).
    weight_transport: WeightTransportName = "auto"
    # nccl / gloo: the trainer rank-0 host as the servers see it, and one port per server (set by the
    # launch plan from cluster.weight_sync_port; no defaults, a wrong guess would hang a rendezvous).
    weight_transfer_master_address: str = ""
    weight_transfer_ports: list[int] = field(default_factory=list)
    weight_sync_check: bool = False  # after every update, compare each server's log-probs with the trainer's
    weight_sync_check_atol: float = 1e-3
    # With weight_sync_check: check only the updates whose version is a multiple of this (1: every one).
    # The check is a trainer forward plus a scoring request per server: sample it when updates must be fast.
    weight_sync_check_every: int = 1
    health_check_interval_s: float = 10.0  # servers failing it stop getting episodes (theirs re-run elsewhere)
    # With every server out of service: how long the run waits for one to come back (a restarted
    # server rejoins with the current weights) before it stops with a checkpoint.
    server_deadline_s: float = 300.0
    # A server that answers /health again but fails its rejoining update (a timeout, a failed weight check)
    # is tried again after its next health answer, this many rejoins in all; then it stays out for the run.
    rejoin_attempts: int = 3
    # The trainer starts while its vllm_server servers still load (the two cold starts overlap); a
    # server with no /health answer this long after the trainer built its models stops the run
    # (SAO_HEALTH_TIMEOUT_S).
    server_start_timeout_s: float = 1800.0
    # No episode starts before this many vllm_server servers are in service (0: all of them). 1 starts
    # on the first server up; a larger value puts every server in the first batches (a fair throughput
    # measurement, or a fleet that must all load before the run counts). Start-up only: a server that
    # dies later does not hold the run.
    start_min_servers: int = 1
    vllm_serve_args: list[str] = field(default_factory=list)  # extra `vllm serve` flags of the launch plan
    # Rollout routing replay (R3, MoE actors only): the engines return the experts every token was routed
    # to, the trajectory keeps them, and the actor's forward replays them (megatron/routing_replay.py).
    routing_replay: bool = False
    # Return and store the engines' routes without replaying them: moe/routing_agreement measured with the
    # trainer's own routing (routing_replay implies it).
    record_routes: bool = False
    agent_endpoint: AgentEndpointConfig = field(default_factory=AgentEndpointConfig)

    @property
    def returns_routes(self) -> bool:
        return self.routing_replay or self.record_routes


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
    # uid under seccomp, Landlock and rlimits (envs/sandbox.py, process mode); refused unless true.
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
    # The fresh value head's LR while it is fitted here; None: critic.value_head_lr. A head drawn at zero
    # wants a high one to reach the returns in a few steps; the same head, pretrained, moves at a lower
    # critic.value_head_lr in RL (at the high one it chases each batch's mean return: docs/results.md 7).
    value_head_lr: Optional[float] = None
    # Apply `critic.freeze` (attention, embeddings, router, norms by default) during pretraining too.
    # Off: pretraining fits the whole critic; the paper freezes attention during RL only.
    apply_critic_freeze: bool = False
    # Fit on the rollouts of an earlier run (its value_pretrain_rollouts.safetensors) instead of rolling
    # out: the same data under other fitting settings. They must come from this config's policy and task.
    rollouts_file: Optional[str] = None
    # Share of the rollouts' prompts the critic never trains on: held-out EV, value and loss.
    heldout_fraction: float = 0.2
    eval_every: int = 1  # critic steps between held-out evaluations (the first and last step always)
    # Stop when the held-out EV has not improved by more than min_delta over `patience` evaluations;
    # the critic written is the one of the best held-out EV. 0: run all `steps`.
    patience: int = 5
    min_delta: float = 0.002
    # Where pretrained critics are kept, one per SFT model and pretraining settings (trainer/critic_cache.py):
    # a second `sao value-pretrain` with the same policy weights and settings copies it instead of
    # rolling out and fitting again. None: no cache.
    cache_dir: Optional[str] = None


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

    def value_pretrain_critic(self) -> CriticConfig:
        """The critic settings value pretraining fits with: `critic`, with value_pretrain.lr and
        value_pretrain.value_head_lr in place of the RL run's learning rates where they are set."""
        v, c = self.value_pretrain, self.critic
        optim = replace(c.optim, lr=v.lr) if v.lr is not None else c.optim
        return replace(c, optim=optim, value_head_lr=v.value_head_lr if v.value_head_lr is not None
                       else c.value_head_lr)
