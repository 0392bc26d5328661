"""Divisibility and placement checks of a trainer/rollout layout, before any process starts.

Each check mirrors an assertion Megatron-Core or vLLM makes much later (often minutes into a
multi-node job, deep inside `initialize_model_parallel` or a layer constructor). Failing here, with
the config field to change, is the point. `check_layout` collects every problem instead of
stopping at the first, so one `sao plan` run lists everything that needs fixing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_sao.config import SAOConfig
from megatron_sao.models.hf_config import ModelSpec


@dataclass(frozen=True)
class LayoutIssue:
    """One problem: the dotted config field to change and why."""

    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.field}: {self.reason}"


class LayoutError(ValueError):
    """An impossible layout; `issues` lists every problem found."""

    def __init__(self, issues: list[LayoutIssue]) -> None:
        self.issues = list(issues)
        super().__init__("; ".join(str(i) for i in self.issues))


@dataclass(frozen=True)
class Layout:
    """The resolved sizes of the trainer's Megatron world."""

    world: int  # trainer GPUs (ranks)
    tp: int
    pp: int
    ep: int
    etp: int  # expert tensor parallel
    dp: int  # data parallel of dense params: world / (tp * pp)
    edp: int  # expert data parallel: dp * tp / (ep * etp)
    rollout_servers: int
    warnings: list[str] = field(default_factory=list)


def _divides(issues: list[LayoutIssue], key: str, divisor: int, value: int, what: str) -> None:
    if divisor < 1 or value % divisor:
        issues.append(LayoutIssue(key, f"{key.split('.')[-1]}={divisor} must divide {what}={value}"))


def check_layout(cfg: SAOConfig, spec: ModelSpec, *, etp: int = 1, world: int | None = None) -> Layout:
    """Validate `cfg`'s parallel + cluster sections against `spec`; raise LayoutError listing every issue.

    `world` overrides trainer_nodes * gpus_per_node (e.g. an embedded CPU run with 2 ranks).
    `etp` is Megatron's expert_tensor_parallel_size (1 = each expert whole on one EP rank).
    """
    p, c, r = cfg.parallel, cfg.cluster, cfg.rollout
    issues: list[LayoutIssue] = []
    warnings: list[str] = []
    if c.trainer_nodes < 1:
        issues.append(LayoutIssue("cluster.trainer_nodes", f"must be >= 1, got {c.trainer_nodes}"))
    if c.gpus_per_node < 1:
        issues.append(LayoutIssue("cluster.gpus_per_node", f"must be >= 1, got {c.gpus_per_node}"))
    if etp < 1:
        issues.append(LayoutIssue("parallel.etp", f"expert tensor parallel size must be >= 1, got {etp}"))
    if world is None:
        world = max(c.trainer_nodes, 0) * max(c.gpus_per_node, 0)
    if issues:
        raise LayoutError(issues)
    tp, pp, ep = p.tp, p.pp, p.ep

    # --- the model: how Megatron shards each tensor
    _divides(issues, "parallel.tp", tp, spec.num_attention_heads, "num_attention_heads")
    _divides(issues, "parallel.tp", tp, spec.num_kv_heads, "num_key_value_heads (qkv is split by query group)")
    _divides(issues, "parallel.tp", tp, spec.vocab_size, "vocab_size (no vocab padding in the HF mapping)")
    _divides(issues, "parallel.pp", pp, spec.num_layers, "num_hidden_layers")
    if spec.is_moe:
        _divides(issues, "parallel.ep", ep, spec.num_experts, "num_experts")
        _divides(issues, "parallel.etp", etp, spec.moe_ffn_hidden_size, "moe_intermediate_size")
        if tp > 1 and not p.sequence_parallel:
            issues.append(LayoutIssue("parallel.sequence_parallel",
                                      "MoE layers with tp > 1 need sequence_parallel: true (Megatron asserts it)"))
    else:
        if ep != 1:
            issues.append(LayoutIssue("parallel.ep", f"ep={ep} needs an MoE model; {spec.arch} is dense"))
        _divides(issues, "parallel.tp", tp, spec.ffn_hidden_size, "intermediate_size")

    # --- the cluster: how Megatron lays the groups over the ranks
    dp = edp = 0
    if world % (tp * pp):
        issues.append(LayoutIssue("parallel.tp", f"tp*pp={tp}*{pp} must divide the trainer world size {world} "
                                                 f"(cluster.trainer_nodes*cluster.gpus_per_node)"))
    else:
        dp = world // (tp * pp)
        # Megatron folds the expert grid (ep x etp) over the dp*tp ranks of one pipeline stage;
        # what is left over is the expert-data-parallel group the expert optimizer shards over.
        if (dp * tp) % (ep * etp):
            issues.append(LayoutIssue("parallel.ep", f"ep*etp={ep}*{etp} must divide dp*tp={dp}*{tp} "
                                                     f"(the ranks of one pipeline stage, expert data parallel)"))
        else:
            edp = dp * tp // (ep * etp)
    if tp > c.gpus_per_node:
        warnings.append(f"parallel.tp={tp} spans nodes (gpus_per_node={c.gpus_per_node}): TP all-reduces "
                        "would cross the network")
    if dp and cfg.buffer.batch_size % dp:
        warnings.append(f"buffer.batch_size={cfg.buffer.batch_size} is not a multiple of dp={dp}: "
                        "some data-parallel ranks get one trajectory fewer per step")

    # --- placement: where the rollout engines live
    servers = _check_placement(cfg, spec, issues)
    if r.max_total_tokens > spec.max_position_embeddings:
        issues.append(LayoutIssue("rollout.max_total_tokens",
                                  f"{r.max_total_tokens} exceeds the model's max_position_embeddings="
                                  f"{spec.max_position_embeddings} (use a long-context checkpoint, e.g. the "
                                  "-2507 variants with 262144 positions)"))
    if cfg.model.max_seq_len < r.max_total_tokens:
        warnings.append(f"model.max_seq_len={cfg.model.max_seq_len} < rollout.max_total_tokens="
                        f"{r.max_total_tokens}: the longest trajectories cannot be trained on whole")
    if issues:
        raise LayoutError(issues)
    return Layout(world=world, tp=tp, pp=pp, ep=ep, etp=etp, dp=dp, edp=edp, rollout_servers=servers,
                  warnings=warnings)


def _check_placement(cfg: SAOConfig, spec: ModelSpec, issues: list[LayoutIssue]) -> int:
    """Placement-specific checks; returns the number of rollout servers (0 = in-process engine)."""
    c, r = cfg.cluster, cfg.rollout
    if c.placement == "embedded":
        if c.rollout_nodes:
            issues.append(LayoutIssue("cluster.rollout_nodes", "must be 0 for placement embedded"))
        return 0
    if c.rollout_tp < 1 or c.gpus_per_node % c.rollout_tp:
        issues.append(LayoutIssue("cluster.rollout_tp", f"rollout_tp={c.rollout_tp} must divide "
                                                        f"cluster.gpus_per_node={c.gpus_per_node} (one server per GPU group)"))
        return 0
    # vLLM splits query heads evenly over its TP ranks (KV heads may be replicated).
    _divides(issues, "cluster.rollout_tp", c.rollout_tp, spec.num_attention_heads, "num_attention_heads")
    if c.placement == "colocated":
        if c.rollout_nodes:
            issues.append(LayoutIssue("cluster.rollout_nodes", "must be 0 for placement colocated "
                                                               "(vLLM runs on the trainer GPUs)"))
        if not r.colocate:
            issues.append(LayoutIssue("rollout.colocate", "must be true for placement colocated (sleep/wake)"))
        if r.backend != "vllm":
            issues.append(LayoutIssue("rollout.backend", f"placement colocated needs backend vllm, got {r.backend}"))
        return c.trainer_nodes * c.gpus_per_node // c.rollout_tp
    # disaggregated
    if c.rollout_nodes < 1:
        issues.append(LayoutIssue("cluster.rollout_nodes", "placement disaggregated needs >= 1 rollout node"))
    if r.colocate:
        issues.append(LayoutIssue("rollout.colocate", "must be false for placement disaggregated"))
    if r.backend == "hf":
        issues.append(LayoutIssue("rollout.backend", "placement disaggregated needs vllm or vllm_server "
                                                     "(the launcher sets vllm_server and the urls)"))
    return c.rollout_nodes * c.gpus_per_node // c.rollout_tp
