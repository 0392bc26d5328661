"""`sao plan`: check a layout and estimate per-GPU memory before a multi-node job is submitted.

    python -m megatron_sao.cluster.planner examples/qwen3_30b_a3b/aime_disaggregated.yaml \
        --gpu-mem-gib 80 parallel.ep=8

prints the parameter counts, the trainer world (TP/PP/EP/ETP/DP/EDP), per-GPU memory of the actor
and the critic (weights, gradients, optimizer shards, activations with and without full
recompute, logits; the batch, its outputs and the RoPE cache) and of one vLLM server (weights, KV
cache), then a verdict. Exit codes: 0 the layout fits, 2 it is impossible (the message names the
config field), 1 unexpected errors.

The planner reads the same settings the trainer builds from, through the same functions, so the
two cannot disagree: the layout and expert-TP size (`ParallelSizes.from_config`, the one default
etp rule), the training dtype (`model.dtype`: bf16 mixed precision or fp32, `models.precision`),
the attention kernel that dtype allows on TransformerEngine (fused: no s x s matrix; fp32 or the
local spec: unfused, s x s scores counted), and activation recompute (`parallel.recompute`). A
config that fits only with full recompute but does not set `parallel.recompute: full` is refused
with that key, instead of running out of memory on the first long batch.

Colocated placement (`cluster.placement: colocated`): trainer and vLLM take turns on each GPU, so the
plan has three phases (`memory.colocated_phases`): rollout (vLLM awake at its
`rollout.gpu_memory_utilization` share, the trainer offloaded to host memory), train (the trainer's
peak beside a sleeping engine) and the in-process weight update (the actor's parameters, the engine's
weights and two export buckets); a layout any phase overflows is refused with the key to change, and
the host memory the offloaded trainer takes per node is reported.

Assumptions (stated so a reader can disagree with a number): in the other placements actor and
critic stay resident on the same trainer GPUs for the whole step; Megatron's distributed optimizer with
fp32 gradient accumulation; 1F1B pipeline schedule; balanced expert routing; TransformerEngine
installed on the nodes (`--no-te` plans the local-spec fallback); a fixed per-GPU overhead for the
CUDA context, NCCL buffers and allocator fragmentation (`--overhead-gib`, empirical, not from a
formula).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from megatron_sao.cluster import memory as mem
from megatron_sao.cluster.layout import Layout, LayoutError, LayoutProblem, check_layout
from megatron_sao.config import ConfigError, SAOConfig, load_config
from megatron_sao.models.hf_config import ModelSpec, model_spec_from_hf
from megatron_sao.models.precision import FUSED, attention_kernel, dtype_bytes
from megatron_sao.models.vocab import padded_vocab_size

_BUILTIN_DIR = Path(__file__).resolve().parent.parent / "models" / "configs"
# Checkpoints whose config differs from a shipped one only in RoPE/context (per the model cards):
# the -2507 releases of Qwen3-30B-A3B have 262144 positions and rope_theta 1e7.
_KNOWN_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-30b-a3b": ("qwen3_30b_a3b.json", {}),
    "qwen3-30b-a3b-base": ("qwen3_30b_a3b.json", {}),
    "qwen3-30b-a3b-thinking-2507": ("qwen3_30b_a3b.json", {"rope_theta": 1e7, "max_position_embeddings": 262144}),
    "qwen3-30b-a3b-instruct-2507": ("qwen3_30b_a3b.json", {"rope_theta": 1e7, "max_position_embeddings": 262144}),
}


@dataclass(frozen=True)
class PlanOptions:
    """Planner inputs that the config does not (yet) carry."""

    gpu_mem_gib: float = 80.0  # memory of one GPU (H100/A100-80G: 80, H200: 141)
    etp: int | None = None  # expert tensor parallel size; None = parallel.etp or the trainer's default rule
    world: int | None = None  # trainer ranks; None = cluster.trainer_nodes * cluster.gpus_per_node
    overhead_gib: float = 4.0  # CUDA context + NCCL + fragmentation, per GPU
    transformer_engine: bool = True  # the nodes build the TE layer spec (False: the local-spec fallback)


@dataclass
class RoleMemory:
    """Per-GPU bytes of one trainer model (actor or critic) on its heaviest pipeline stage."""

    trainable_params: int
    frozen_params: int
    weights_grads_optimizer: float
    activations: float  # no recompute
    activations_recompute: float  # full recompute
    logits: float
    routes: float = 0.0  # routing replay (actor): a micro-batch's routes and its routers' int64 targets
    routes_recompute: float = 0.0  # the same with full recompute (targets of the forwards in flight)

    def total(self, recompute: bool) -> float:
        return self.weights_grads_optimizer + self.step(recompute)

    def step(self, recompute: bool) -> float:
        """What the model's step adds to its static bytes: activations, logits, routes."""
        if recompute:
            return self.activations_recompute + self.logits + self.routes_recompute
        return self.activations + self.logits + self.routes


@dataclass
class Plan:
    """Everything `sao plan` reports; `fits` is the verdict."""

    spec: ModelSpec
    layout: Layout
    total_params: int
    active_params: int
    seq_len: int
    micro_batch: int
    actor: RoleMemory
    critic: RoleMemory | None
    trainer_static: float  # weights + grads + optimizer of both models + overhead
    step_buffers: float  # the batch on the device, its micro-batches and outputs, the RoPE cache
    trainer_peak: float  # with the config's recompute setting
    recompute_needed: bool  # the step does not fit without full recompute
    dtype: str  # model.dtype the trainer builds in
    attention: str  # "fused" (no s x s matrix) or "unfused": what the trainer's TransformerConfig selects
    recompute: bool  # parallel.recompute == "full": what the trainer's TransformerConfig gets
    padded_vocab: int  # rows of the embedding / LM head (models/vocab.py)
    rollout_weights: float  # per GPU of one vLLM server
    rollout_kv_budget: float
    kv_bytes_per_token: float
    full_sequences_per_server: int
    options: PlanOptions
    problems: list[LayoutProblem] = field(default_factory=list)
    colocated: mem.ColocatedPhases | None = None  # per-phase bytes of a colocated step
    routes_host: float = 0.0  # routing replay: the batch's routes in each trainer rank's host memory

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fits"] = self.fits
        return out


def resolve_hf_config(cfg: SAOConfig, hf_config: str | Mapping[str, Any] | None = None) -> ModelSpec:
    """The ModelSpec for `cfg.model.path`: an HF dir, a config.json, or a known model name."""
    if hf_config is not None:
        return model_spec_from_hf(hf_config)
    path = Path(cfg.model.path)
    if path.is_dir() or path.is_file():
        return model_spec_from_hf(path)
    key = path.name.lower()
    if key in _KNOWN_MODELS:
        fname, patch = _KNOWN_MODELS[key]
        data = json.loads((_BUILTIN_DIR / fname).read_text())
        data.update(patch)
        return model_spec_from_hf(data)
    raise ConfigError(f"model.path: {cfg.model.path!r} is neither a directory with config.json nor a known "
                      f"model ({sorted(_KNOWN_MODELS)}); pass --hf-config PATH")


def micro_batch_rows(cfg: SAOConfig) -> float:
    """Rows of model.max_seq_len tokens in the largest micro-batch: parallel.micro_batch_size, or fewer
    when parallel.max_tokens_per_micro_batch holds fewer such rows (a fraction: the budget's tokens in
    shorter rows; activations and logits are linear in tokens, and the s x s term is largest when the
    budget's tokens come in rows of max_seq_len)."""
    b = float(cfg.parallel.micro_batch_size)
    budget = cfg.parallel.max_tokens_per_micro_batch
    return b if budget is None else min(b, budget / cfg.model.max_seq_len)


def _role_memory(spec: ModelSpec, layout: Layout, cfg: SAOConfig, opts: PlanOptions, role: str) -> RoleMemory:
    """Worst pipeline stage of `role` ("actor" or "critic") on one GPU."""
    counts = mem.count_params(spec)
    tp, pp, ep, etp = layout.tp, layout.pp, layout.ep, layout.etp
    nbytes_el = dtype_bytes(cfg.model.dtype)
    flash = attention_kernel(cfg.model.dtype, opts.transformer_engine) == FUSED
    vocab_rows = padded_vocab_size(spec.vocab_size, tp) * spec.hidden_size  # embedding / LM head rows as built
    layers = spec.num_layers // pp
    frozen_attention = role == "critic" and "attention" in cfg.critic.freeze
    # Per layer on one rank: TP-sharded attention, replicated norms/router, EP x ETP-sharded experts.
    attn = counts.attention / tp + counts.qk_norm
    dense = counts.layer_norms + counts.router + counts.dense_mlp / tp
    experts = counts.experts / (ep * etp)
    output = 0 if spec.tie_word_embeddings and pp == 1 else vocab_rows  # a tied head at pp > 1 is a copy
    head = output / tp if role == "actor" else spec.hidden_size  # LM head vs value head [1, H]
    stages = []
    for stage in range(pp):
        extra = (vocab_rows / tp if stage == 0 else 0) + (head + counts.final_norm if stage == pp - 1 else 0)
        frozen = layers * attn if frozen_attention else 0.0
        trainable_dense = layers * (dense + (0 if frozen_attention else attn)) + extra
        trainable_experts = layers * experts
        nbytes = (trainable_dense * mem.trainable_bytes_per_param(layout.dp, param_bytes=nbytes_el)
                  + trainable_experts * mem.trainable_bytes_per_param(layout.edp, param_bytes=nbytes_el)
                  + frozen * nbytes_el)
        stages.append((nbytes, int(trainable_dense + trainable_experts), int(frozen)))
    nbytes, trainable, frozen = max(stages)
    s, b = cfg.model.max_seq_len, micro_batch_rows(cfg)
    sp = cfg.parallel.sequence_parallel
    # 1F1B: the first stage holds min(pp, microbatches) micro-batches of its layers (= all L
    # layers' worth when there are enough micro-batches, Korthikanti et al. section 4.2.3).
    n_micro = max(1, int(cfg.buffer.batch_size // max(1.0, layout.dp * b)))
    held = layers * min(pp, n_micro)
    shape = mem.LayerShape.from_spec(spec)
    per_layer = mem.layer_activation_bytes(shape, s, b, tp, sp, flash, etp if spec.is_moe else None, nbytes_el)
    act = held * per_layer
    # Full recompute keeps each layer's input and rebuilds one layer's activations in backward.
    act_rc = held * mem.recompute_layer_bytes(spec.hidden_size, s, b, tp, sp, nbytes_el) + per_layer
    logits = mem.logits_bytes(padded_vocab_size(spec.vocab_size, tp), s, b, tp, nbytes_el) if role == "actor" else 0.0
    routes = routes_rc = 0.0
    if role == "actor" and spec.is_moe and cfg.rollout.returns_routes:  # the critic routes by itself
        def replay(held: int) -> float:
            return mem.replay_routes_bytes(b, s, layers=spec.num_layers, stage_layers=layers, topk=spec.moe_topk,
                                           num_experts=spec.num_experts, router_tokens=b * s / (tp if sp else 1),
                                           held=held)
        routes, routes_rc = replay(1), replay(min(pp, n_micro))
    return RoleMemory(trainable, frozen, nbytes, act, act_rc, logits, routes, routes_rc)


def plan(cfg: SAOConfig, hf_config: str | Mapping[str, Any] | ModelSpec | None = None,
         options: PlanOptions | None = None) -> Plan:
    """Check the layout of `cfg` and estimate memory. Raises LayoutError for an impossible layout.

    A layout that is valid but does not fit in memory is returned with `plan.problems` set (and
    `fits` False), so callers can print the numbers that explain why.
    """
    opts = options or PlanOptions()
    spec = hf_config if isinstance(hf_config, ModelSpec) else resolve_hf_config(cfg, hf_config)
    layout = check_layout(cfg, spec, etp=opts.etp, world=opts.world)
    counts = mem.count_params(spec)
    actor = _role_memory(spec, layout, cfg, opts, "actor")
    critic = _role_memory(spec, layout, cfg, opts, "critic") if cfg.algorithm.uses_critic else None
    overhead = opts.overhead_gib * mem.GIB
    models = [m for m in (actor, critic) if m is not None]
    static = sum(m.weights_grads_optimizer for m in models) + overhead
    # Actor and critic train one after the other: only one model's activations are live at a time.
    budget = opts.gpu_mem_gib * mem.GIB
    buffers = (mem.batch_bytes(cfg.buffer.batch_size, cfg.model.max_seq_len, layout.dp)
               + mem.rope_cache_bytes(spec.head_dim, cfg.model.max_seq_len))
    routes_host = (mem.host_routes_bytes(cfg.buffer.batch_size, cfg.model.max_seq_len, layout.dp,
                                         layers=spec.num_layers, topk=spec.moe_topk, num_experts=spec.num_experts)
                   if spec.is_moe and cfg.rollout.returns_routes else 0.0)
    peak_plain = static + buffers + max(m.step(False) for m in models)
    peak_recompute = static + buffers + max(m.step(True) for m in models)
    recompute = cfg.parallel.recompute == "full"
    recompute_needed = peak_plain > budget
    peak = peak_recompute if recompute else peak_plain

    problems: list[LayoutProblem] = []
    if peak_recompute > budget:
        problems.append(LayoutProblem("cluster.trainer_nodes", (
            f"trainer needs {peak_recompute / mem.GIB:.1f} GiB per GPU even with full recompute, over the "
            f"{opts.gpu_mem_gib:g} GiB budget: add trainer nodes, raise parallel.ep/pp, or shorten model.max_seq_len")))
    elif peak > budget:
        problems.append(LayoutProblem("parallel.recompute", (
            f"without activation recompute the trainer needs {peak / mem.GIB:.1f} GiB per GPU, over the "
            f"{opts.gpu_mem_gib:g} GiB budget; with it {peak_recompute / mem.GIB:.1f} GiB: "
            f"set parallel.recompute: full")))

    # vLLM: bf16 weights split over the server's TP ranks (experts too: vLLM shards them with TP).
    r, c = cfg.rollout, cfg.cluster
    rtp = c.rollout_tp if c.placement != "embedded" else 1
    weights = counts.total * mem.BF16 / rtp
    usable = r.gpu_memory_utilization * budget
    kv_budget = usable - weights - overhead / 2  # vLLM's own activations/graphs: half the trainer overhead
    phases = None
    if c.placement == "colocated":
        phases = _colocated_phases(cfg, spec, layout, opts, actor, static, peak, usable, weights)
        problems += _colocated_problems(phases, budget, opts)
    per_token = mem.kv_cache_bytes_per_token(spec, rtp)
    full = int(max(kv_budget, 0) // (per_token * r.max_total_tokens))
    if c.placement != "embedded" and full < 1:
        # vLLM refuses to start when max_model_len tokens do not fit in the KV cache.
        problems.append(LayoutProblem("rollout.gpu_memory_utilization", (
            f"a vLLM server (tp={rtp}) has {max(kv_budget, 0) / mem.GIB:.1f} GiB of KV cache per GPU, less than one "
            f"{r.max_total_tokens}-token sequence ({per_token * r.max_total_tokens / mem.GIB:.1f} GiB): raise it or "
            "cluster.rollout_tp")))
    return Plan(spec=spec, layout=layout, total_params=counts.total, active_params=counts.active,
                seq_len=cfg.model.max_seq_len, micro_batch=cfg.parallel.micro_batch_size, actor=actor, critic=critic,
                trainer_static=static, step_buffers=buffers, trainer_peak=peak, recompute_needed=recompute_needed,
                dtype=cfg.model.dtype,
                attention=attention_kernel(cfg.model.dtype, opts.transformer_engine), recompute=recompute,
                padded_vocab=padded_vocab_size(spec.vocab_size, layout.tp), rollout_weights=weights,
                rollout_kv_budget=kv_budget, kv_bytes_per_token=per_token, full_sequences_per_server=full,
                options=opts, problems=problems, colocated=phases, routes_host=routes_host)


def _colocated_phases(cfg: SAOConfig, spec: ModelSpec, layout: Layout, opts: PlanOptions, actor: RoleMemory,
                      static: float, peak: float, engine_awake: float, engine_weights: float) -> mem.ColocatedPhases:
    nbytes = dtype_bytes(cfg.model.dtype)
    return mem.colocated_phases(
        overhead=opts.overhead_gib * mem.GIB, engine_awake=engine_awake, trainer_peak=peak, trainer_static=static,
        actor_param_bytes=(actor.trainable_params + actor.frozen_params) * nbytes, engine_weights=engine_weights,
        bucket_bytes=cfg.rollout.weight_sync_bucket_mb * 2**20,
        largest_tensor=mem.largest_gathered_tensor(spec, layout.ep, nbytes))


def _colocated_problems(ph: mem.ColocatedPhases, budget: float, opts: PlanOptions) -> list[LayoutProblem]:
    g = lambda x: f"{x / mem.GIB:.1f} GiB"  # noqa: E731
    out = []
    if ph.rollout > budget:
        out.append(LayoutProblem("rollout.gpu_memory_utilization", (
            f"the awake colocated engine takes {g(ph.rollout - opts.overhead_gib * mem.GIB)} "
            f"plus {opts.overhead_gib:g} "
            f"GiB overhead, over the {opts.gpu_mem_gib:g} GiB GPU: lower it")))
    if ph.train > budget:
        out.append(LayoutProblem("cluster.trainer_nodes", (
            f"the train phase needs {g(ph.train)} per GPU (trainer peak + {mem.ENGINE_ASLEEP_GIB:g} GiB a sleeping "
            f"engine keeps), over the {opts.gpu_mem_gib:g} GiB GPU: add trainer nodes or raise parallel.ep")))
    if ph.update > budget:
        out.append(LayoutProblem("rollout.weight_sync_bucket_mb", (
            f"the weight update needs {g(ph.update)} per GPU (actor params + engine weights + two buckets), over "
            f"the {opts.gpu_mem_gib:g} GiB GPU: lower it or raise cluster.rollout_tp")))
    return out


def render(p: Plan, cfg: SAOConfig) -> str:
    """Human-readable report (plain text, fixed-width; also fine in a SLURM log)."""
    g = lambda x: f"{x / mem.GIB:8.2f} GiB"  # noqa: E731
    L = p.layout
    lines = [
        f"model      {p.spec.arch}: {p.total_params / 1e9:.2f}B params total, {p.active_params / 1e9:.2f}B active",
        f"trainer    world={L.world} tp={L.tp} pp={L.pp} ep={L.ep} etp={L.etp} dp={L.dp} edp={L.edp} "
        f"seq={p.seq_len} micro_batch={p.micro_batch} max_tokens_per_micro_batch="
        f"{cfg.parallel.max_tokens_per_micro_batch} sp={cfg.parallel.sequence_parallel}",
        f"precision  {p.dtype}, {p.attention} attention, recompute={'full' if p.recompute else 'none'}, "
        f"vocab {p.spec.vocab_size} padded to {p.padded_vocab}",
        f"placement  {cfg.cluster.placement}: {L.rollout_servers} rollout server(s), tp={cfg.cluster.rollout_tp}",
        "per GPU (heaviest pipeline stage)",
    ]
    for name, m in (("actor", p.actor), ("critic", p.critic)):
        if m is None:
            continue
        lines += [
            f"  {name:6s} params {m.trainable_params / 1e9:.3f}B trainable, {m.frozen_params / 1e9:.3f}B frozen",
            f"  {name:6s} weights+grads+optimizer {g(m.weights_grads_optimizer)}",
            f"  {name:6s} activations             {g(m.activations)}  (full recompute: {g(m.activations_recompute)})",
            f"  {name:6s} logits                  {g(m.logits)}",
        ]
        if m.routes:
            lines.append(f"  {name:6s} routes (routing replay) {g(m.routes)}  (full recompute: "
                         f"{g(m.routes_recompute)}; host per rank {g(p.routes_host)})")
    lines += [
        f"  batch, outputs, RoPE cache     {g(p.step_buffers)}",
        f"  overhead                       {g(p.options.overhead_gib * mem.GIB)}",
        f"  trainer peak                   {g(p.trainer_peak)}  of {p.options.gpu_mem_gib:g} GiB"
        f"{'  (needs full recompute)' if p.recompute_needed else ''}",
        f"rollout    weights/GPU {g(p.rollout_weights)}, KV budget/GPU {g(p.rollout_kv_budget)}, "
        f"{p.kv_bytes_per_token / 1024:.0f} KiB/token/GPU, {p.full_sequences_per_server} full "
        f"{cfg.rollout.max_total_tokens}-token sequences per server",
    ]
    if p.colocated is not None:
        ph = p.colocated
        lines.append(f"colocated  per GPU: rollout {g(ph.rollout)} | train {g(ph.train)} | update {g(ph.update)}; "
                     f"host memory for the offloaded trainer {g(ph.host_per_gpu * cfg.cluster.gpus_per_node)} per node")
    lines += [f"warning    {w}" for w in L.warnings]
    lines += [f"REFUSED    {i}" for i in p.problems]
    lines.append("verdict    " + ("fits" if p.fits else "does not fit"))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sao plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="YAML config (megatron_sao.config)")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    ap.add_argument("--hf-config", default=None, help="HF config.json or checkpoint dir (default: model.path)")
    ap.add_argument("--gpu-mem-gib", type=float, default=None, help="default: cluster.gpu_memory_gib")
    ap.add_argument("--etp", type=int, default=None,
                    help="expert tensor parallel size (default: parallel.etp, else the trainer's rule)")
    ap.add_argument("--no-te", action="store_true",
                    help="plan the local (non-TransformerEngine) layer spec: unfused attention")
    ap.add_argument("--world", type=int, default=None, help="trainer ranks (default nodes*gpus_per_node)")
    ap.add_argument("--overhead-gib", type=float, default=PlanOptions.overhead_gib)
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `sao plan`; returns 0 (fits), 2 (refused, reason printed) or 1."""
    args = build_parser().parse_intermixed_args(argv)  # overrides may follow options
    try:
        cfg = load_config(args.config, args.overrides)
        gpu_mem = args.gpu_mem_gib if args.gpu_mem_gib is not None else cfg.cluster.gpu_memory_gib
        opts = PlanOptions(gpu_mem_gib=gpu_mem, etp=args.etp, world=args.world, overhead_gib=args.overhead_gib,
                           transformer_engine=not args.no_te)
        p = plan(cfg, args.hf_config, opts)
    except LayoutError as e:
        for issue in e.issues:
            print(f"sao plan: refused: {issue}", file=sys.stderr)
        return 2
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"sao plan: refused: {e}", file=sys.stderr)
        return 2
    print(json.dumps(p.to_dict(), indent=2, default=str) if args.json else render(p, cfg))
    for issue in p.problems:
        print(f"sao plan: refused: {issue}", file=sys.stderr)
    return 0 if p.fits else 2


if __name__ == "__main__":
    sys.exit(main())


def trainer_memory_check(cfg: SAOConfig, model_dir: str | Path, gpu_mem_gib: float, world: int,
                         transformer_engine: bool = True) -> None:
    """The planner's trainer verdict, run by the trainer itself on GPUs before it builds a model.

    The sbatch scripts run `sao plan` first, but a job started with SAO_SKIP_PLAN=1 or by a
    hand-written torchrun would skip it and run out of memory in its first step. Raises ConfigError
    naming the field (parallel.recompute, cluster.trainer_nodes) when the trainer does not fit;
    rollout-side problems are the launch plan's business, not the trainer's.
    """
    config_json = Path(model_dir) / "config.json"
    opts = PlanOptions(gpu_mem_gib=gpu_mem_gib, world=world, transformer_engine=transformer_engine)
    p = plan(cfg, str(config_json) if config_json.exists() else None, opts)
    trainer = [i for i in p.problems if i.field in ("parallel.recompute", "cluster.trainer_nodes")]
    if trainer:
        raise ConfigError("; ".join(map(str, trainer)) + f" (planned for {gpu_mem_gib:.0f} GiB GPUs, {world} ranks; "
                          "`sao plan` shows the figures; SAO_SKIP_PLAN=1 skips this check)")
