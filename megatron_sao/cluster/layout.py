"""Divisibility and placement checks of a trainer/rollout layout, before any process starts.

Each check mirrors an assertion Megatron-Core or vLLM makes much later (often minutes into a
multi-node job, deep inside `initialize_model_parallel` or a layer constructor). Failing here, with
the config field to change, is the point. `check_layout` collects every problem instead of
stopping at the first, so one `sao plan` run lists everything that needs fixing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_sao.config import SAOConfig
from megatron_sao.models.hf_config import ModelSpec
from megatron_sao.models.parallel_sizes import LayoutProblem, ParallelSizes


class LayoutError(ValueError):
    """An impossible layout; `issues` lists every problem found."""

    def __init__(self, issues: list[LayoutProblem]) -> None:
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


def _divides(issues: list[LayoutProblem], key: str, divisor: int, value: int, what: str) -> None:
    if divisor < 1 or value % divisor:
        issues.append(LayoutProblem(key, f"{key.split('.')[-1]}={divisor} must divide {what}={value}"))


def trainer_sizes(cfg: SAOConfig, etp: int | None = None) -> ParallelSizes:
    """The trainer's ParallelSizes for `cfg` (what `sao train` builds); `etp` overrides parallel.etp."""
    sizes = ParallelSizes.from_config(cfg.parallel)
    return sizes if etp is None else dataclasses.replace(sizes, etp=etp)


def check_layout(cfg: SAOConfig, spec: ModelSpec, *, etp: int | None = None, world: int | None = None) -> Layout:
    """Validate `cfg`'s parallel + cluster sections against `spec`; raise LayoutError listing every issue.

    `world` overrides trainer_nodes * gpus_per_node (e.g. an embedded CPU run with 2 ranks).
    `etp` overrides `parallel.etp`; unset, both fall back to the trainer's rule
    (`models.parallel_sizes.default_expert_tp`). The TP/PP/EP/ETP rules are the trainer's own
    (`ParallelSizes.problems`), so a layout the planner accepts is one `init_parallel` accepts.
    """
    c, r = cfg.cluster, cfg.rollout
    issues: list[LayoutProblem] = []
    warnings: list[str] = []
    if c.trainer_nodes < 1:
        issues.append(LayoutProblem("cluster.trainer_nodes", f"must be >= 1, got {c.trainer_nodes}"))
    if c.gpus_per_node < 1:
        issues.append(LayoutProblem("cluster.gpus_per_node", f"must be >= 1, got {c.gpus_per_node}"))
    if etp is not None and etp < 1:
        issues.append(LayoutProblem("parallel.etp", f"expert tensor parallel size must be >= 1, got {etp}"))
    if world is None:
        world = max(c.trainer_nodes, 0) * max(c.gpus_per_node, 0)
    if issues:
        raise LayoutError(issues)
    try:
        sizes = trainer_sizes(cfg, etp)
    except ValueError as exc:
        raise LayoutError([LayoutProblem("parallel", str(exc))]) from None
    tp, pp, ep = sizes.tp, sizes.pp, sizes.ep
    issues += [LayoutProblem(x.field, x.reason) for x in sizes.problems(spec, world)]
    dp = edp = 0
    if not issues:
        dp, edp = sizes.data_parallel(world)
    if tp > c.gpus_per_node:
        warnings.append(f"parallel.tp={tp} spans nodes (gpus_per_node={c.gpus_per_node}): TP all-reduces "
                        "would cross the network")
    if dp and cfg.buffer.batch_size % dp:
        warnings.append(f"buffer.batch_size={cfg.buffer.batch_size} is not a multiple of dp={dp}: "
                        "some data-parallel ranks get one trajectory fewer per step")

    # --- placement: where the rollout engines live
    servers = _check_placement(cfg, spec, issues)
    if r.max_total_tokens > spec.max_position_embeddings:
        issues.append(LayoutProblem("rollout.max_total_tokens",
                                  f"{r.max_total_tokens} exceeds the model's max_position_embeddings="
                                  f"{spec.max_position_embeddings} (use a long-context checkpoint, e.g. the "
                                  "-2507 variants with 262144 positions)"))
    if cfg.model.max_seq_len < r.max_total_tokens:
        warnings.append(f"model.max_seq_len={cfg.model.max_seq_len} < rollout.max_total_tokens="
                        f"{r.max_total_tokens}: the longest trajectories cannot be trained on whole")
    if issues:
        raise LayoutError(issues)
    return Layout(world=world, tp=tp, pp=pp, ep=ep, etp=sizes.expert_tp, dp=dp, edp=edp, rollout_servers=servers,
                  warnings=warnings)


def _check_placement(cfg: SAOConfig, spec: ModelSpec, issues: list[LayoutProblem]) -> int:
    """Placement-specific checks; returns the number of rollout servers (0 = in-process engine)."""
    c, r = cfg.cluster, cfg.rollout
    if c.placement == "embedded":
        if c.rollout_nodes:
            issues.append(LayoutProblem("cluster.rollout_nodes", "must be 0 for placement embedded"))
        return 0
    if c.rollout_tp < 1 or c.gpus_per_node % c.rollout_tp:
        issues.append(LayoutProblem("cluster.rollout_tp",
                                  f"rollout_tp={c.rollout_tp} must divide "
                                  f"cluster.gpus_per_node={c.gpus_per_node} (one server per GPU group)"))
        return 0
    # vLLM splits query heads evenly over its TP ranks (KV heads may be replicated).
    _divides(issues, "cluster.rollout_tp", c.rollout_tp, spec.num_attention_heads, "num_attention_heads")
    if c.placement == "colocated":
        if c.rollout_nodes:
            issues.append(LayoutProblem("cluster.rollout_nodes", "must be 0 for placement colocated "
                                                               "(vLLM runs on the trainer GPUs)"))
        if not r.colocate:
            issues.append(LayoutProblem("rollout.colocate", "must be true for placement colocated (sleep/wake)"))
        if r.backend != "vllm":
            issues.append(LayoutProblem("rollout.backend", f"placement colocated needs backend vllm, got {r.backend}"))
        if cfg.parallel.pp != 1:  # the engine shards load full tensors on every rank (weights/export.py)
            issues.append(LayoutProblem("parallel.pp", f"placement colocated needs pp=1, got {cfg.parallel.pp}"))
        if r.weight_transport not in ("auto", "reload"):
            issues.append(LayoutProblem("rollout.weight_transport", "placement colocated loads weights in-process "
                                                                  f"(no {r.weight_transport} group); leave it auto"))
        return c.trainer_nodes * c.gpus_per_node // c.rollout_tp
    # disaggregated
    if c.rollout_nodes < 1:
        issues.append(LayoutProblem("cluster.rollout_nodes", "placement disaggregated needs >= 1 rollout node"))
    if r.colocate:
        issues.append(LayoutProblem("rollout.colocate", "must be false for placement disaggregated"))
    if r.backend == "hf":
        issues.append(LayoutProblem("rollout.backend", "placement disaggregated needs vllm or vllm_server "
                                                     "(the launcher sets vllm_server and the urls)"))
    return c.rollout_nodes * c.gpus_per_node // c.rollout_tp


def max_num_seqs(cfg: SAOConfig, engines: int | None) -> int | None:
    """Generate requests one engine runs at once: rollout.max_num_seqs, else an even share of
    rollout.concurrency over `engines` (what the launch plan gives each vllm serve, and each colocated
    engine's vLLM scheduler); None (unbounded) for one in-process engine (`engines=None`)."""
    r = cfg.rollout
    if r.max_num_seqs is not None:
        return r.max_num_seqs
    return -(-r.concurrency // engines) if engines else None
