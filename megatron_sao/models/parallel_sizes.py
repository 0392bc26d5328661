"""Model-parallel sizes of one Megatron world, and the one set of rules every layout must pass.

The trainer (`init_parallel`, `MegatronEngine`), the planner (`sao plan`, `cluster/layout.py`), the
checkpoint converter and the launch plan all build a `ParallelSizes` (from the config's `parallel`
section with `ParallelSizes.from_config`) and ask it the same questions, so they cannot disagree:

* `expert_tp`: the expert tensor-parallel size, `parallel.etp` or, when unset, `default_expert_tp`.
* `problems(spec, world_size)`: every reason the layout cannot run, each with the config key to
  change. Pure arithmetic: no process group, so a test can check every recipe for its world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_sao.models.hf_config import ModelSpec


def default_expert_tp(tp: int, ep: int) -> int:
    """Expert tensor-parallel size when `parallel.etp` is not set.

    Experts stay whole on their EP rank (etp = 1) whenever EP covers TP (ep >= tp): what every
    published Qwen3-30B-A3B recipe runs (e.g. TP 4, EP 32), and what keeps the expert grid
    (etp * ep) small enough to fit the dp * tp ranks of a stage. With ep < tp, etp = 1 would leave
    etp * ep < tp, which trains MoE layers with wrong gradients on megatron-core 0.16.1 (see
    `problems`), so experts are then tensor-sharded like dense layers (etp = tp, Megatron's own
    default).
    """
    return 1 if ep >= tp else tp


@dataclass(frozen=True)
class LayoutProblem:
    """One reason a layout cannot run: the dotted config key to change and why."""

    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.field}: {self.reason}"


@dataclass(frozen=True)
class ParallelSizes:
    """Tensor / pipeline / expert parallel sizes (what `initialize_model_parallel` is called with).

    `etp` is Megatron's expert_tensor_parallel_size; None means `default_expert_tp(tp, ep)`.
    Training an MoE model with tp > 1 also needs sequence_parallel=True (Megatron raises otherwise
    in training mode).
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    etp: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelSizes.{name} must be a positive int, got {value!r}")
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise ValueError(f"ParallelSizes.etp must be a positive int or None, got {self.etp!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("ParallelSizes.sequence_parallel=True needs tp > 1")

    @classmethod
    def from_config(cls, parallel: Any) -> "ParallelSizes":
        """From the config's `parallel` section (anything with tp, pp, ep, etp, sequence_parallel)."""
        return cls(tp=parallel.tp, pp=parallel.pp, ep=parallel.ep, sequence_parallel=parallel.sequence_parallel,
                   etp=parallel.etp)

    @property
    def expert_tp(self) -> int:
        """Effective expert tensor-parallel size."""
        return default_expert_tp(self.tp, self.ep) if self.etp is None else self.etp

    def problems(self, spec: ModelSpec | None = None, world_size: int | None = None) -> list[LayoutProblem]:
        """Every reason these sizes cannot shard `spec` on `world_size` ranks ([] = runs).

        Each check mirrors an assertion Megatron-Core makes much later (in initialize_model_parallel,
        a layer constructor or the first backward), or a measured failure of this project.
        Without `spec` only the world checks run; without `world_size` only the model checks.
        """
        out: list[LayoutProblem] = []
        tp, pp, ep, etp = self.tp, self.pp, self.ep, self.expert_tp

        def need(cond: bool, field: str, reason: str) -> None:
            if not cond:
                out.append(LayoutProblem(field, reason))

        if spec is not None:
            need(spec.num_attention_heads % tp == 0, "parallel.tp",
                 f"tp={tp} must divide num_attention_heads={spec.num_attention_heads}")
            need(spec.num_kv_heads % tp == 0, "parallel.tp",
                 f"tp={tp} must divide num_key_value_heads={spec.num_kv_heads} (qkv is split by query group)")
            need(spec.num_layers % pp == 0, "parallel.pp", f"pp={pp} must divide num_hidden_layers={spec.num_layers}")
            if not spec.is_moe:
                need(ep == 1, "parallel.ep", f"ep={ep} needs an MoE model; {spec.arch} is dense")
                need(spec.ffn_hidden_size % tp == 0, "parallel.tp",
                     f"tp={tp} must divide intermediate_size={spec.ffn_hidden_size}")
            else:
                need(spec.num_experts % ep == 0, "parallel.ep", f"ep={ep} must divide num_experts={spec.num_experts}")
                need(spec.moe_ffn_hidden_size % etp == 0, "parallel.etp",
                     f"expert tp={etp} must divide moe_intermediate_size={spec.moe_ffn_hidden_size}")
                need(tp == 1 or self.sequence_parallel, "parallel.sequence_parallel",
                     "MoE layers with tp > 1 need sequence_parallel: true (Megatron asserts it when training)")
                # Measured on megatron-core 0.16.1 (tests/integration/megatron/workers/engine_parallel.py): TP=2+SP
                # with etp=1, ep=1 gives correct log-probs but gradients that differ from TP=1
                # (post-step log-probs off by 0.24). etp=tp or etp*ep >= tp train correctly.
                need(tp == 1 or etp * ep >= tp, "parallel.etp",
                     f"MoE with tp={tp}, ep={ep}, etp={etp}: etp*ep < tp trains with wrong gradients on "
                     f"megatron-core 0.16.1; set parallel.etp: {tp} (or leave it unset) or raise parallel.ep")
        if world_size is not None:
            if world_size % (tp * pp):
                out.append(LayoutProblem("parallel.tp", f"tp*pp={tp}*{pp} must divide the trainer world size "
                                                        f"{world_size} (cluster.trainer_nodes*cluster.gpus_per_node)"))
            else:
                dp = world_size // (tp * pp)
                # Megatron folds the expert grid (etp x ep) over the dp*tp ranks of one pipeline stage;
                # what is left over is the expert-data-parallel group.
                need((dp * tp) % (etp * ep) == 0, "parallel.ep",
                     f"expert grid etp*ep={etp}*{ep} must divide dp*tp={dp}*{tp} (the ranks of one pipeline "
                     "stage; the rest is expert data parallel)")
        return out

    def validate_for(self, spec: ModelSpec | None = None, world_size: int | None = None) -> None:
        """Raise ValueError listing every problem of `problems(spec, world_size)`."""
        found = self.problems(spec, world_size)
        if found:
            raise ValueError("; ".join(str(p) for p in found))

    def data_parallel(self, world_size: int) -> tuple[int, int]:
        """(dp, expert dp) on `world_size` ranks; call after `validate_for(world_size=...)`."""
        dp = world_size // (self.tp * self.pp)
        return dp, dp * self.tp // (self.expert_tp * self.ep)
