"""Where each full Megatron tensor lives under TP / PP / EP, and how to slice / reassemble it.

Rules (as Megatron-Core's layers partition their weights):
- PP: decoder layers split evenly; embedding on the first stage; final norm, output layer and
  value head on the last. Local names restart at layer 0 on every stage.
- EP: experts split evenly; local expert index = global - ep_rank * (E / EP).
- TP (column-parallel = dim 0, row-parallel = dim 1, norms/router/value head replicated):
  * linear_qkv: dim 0. Megatron stores qkv interleaved per query group ([q_g; k_g; v_g] for each
    group g), so contiguous dim-0 chunks are whole query groups, which is what each rank holds.
  * GLU linear_fc1 ([gate; up]): rank r holds [gate_r; up_r], not a slice of [gate; up].
  * embedding / output_layer: vocab rows (dim 0), after padding the rows to
    `padded_vocab_size(V, TP)` with zeros (models/vocab.py); `unshard_tensor` strips the padding,
    so full tensors always have the HF vocabulary's V rows, whatever the layout.
- Expert weights are split over the *expert* tensor-parallel group (Megatron's
  expert_tensor_parallel_size; unset, `models.parallel_sizes.default_expert_tp`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_sao.models.hf_config import ModelSpec
from megatron_sao.models.names import canonical_name
from megatron_sao.models.parallel_sizes import default_expert_tp
from megatron_sao.models.vocab import padded_vocab_size

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


@dataclass(frozen=True)
class RankLayout:
    """One rank's coordinates in the model-parallel grid (data parallel ranks share a layout)."""

    tp: int = 1
    tp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    etp: int | None = None  # expert tensor parallel size; None = default_expert_tp(tp, ep), the trainer's rule
    etp_rank: int | None = None  # None = tp_rank when etp == tp, else 0 (etp must then be 1)

    def __post_init__(self) -> None:
        for size, rank in (("tp", "tp_rank"), ("pp", "pp_rank"), ("ep", "ep_rank")):
            s, r = getattr(self, size), getattr(self, rank)
            if s < 1 or not 0 <= r < s:
                raise ValueError(f"RankLayout: need {size} >= 1 and 0 <= {rank} < {size}, got {size}={s} {rank}={r}")
        if self.etp_rank is None and self.expert_tp not in (1, self.tp):
            raise ValueError(f"RankLayout: etp={self.etp} differs from tp={self.tp} and 1; pass etp_rank")
        if not 0 <= self.expert_tp_rank < self.expert_tp:
            raise ValueError(f"RankLayout: etp_rank={self.expert_tp_rank} out of range for etp={self.expert_tp}")

    @property
    def expert_tp(self) -> int:
        return default_expert_tp(self.tp, self.ep) if self.etp is None else self.etp

    @property
    def expert_tp_rank(self) -> int:
        if self.etp_rank is not None:
            return self.etp_rank
        return self.tp_rank if self.expert_tp == self.tp else 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def layer_range(self, spec: ModelSpec) -> range:
        """Global decoder layers on this pipeline stage."""
        if spec.num_layers % self.pp:
            raise ValueError(f"pp={self.pp} does not divide num_layers={spec.num_layers}")
        n = spec.num_layers // self.pp
        return range(self.pp_rank * n, (self.pp_rank + 1) * n)

    def expert_range(self, spec: ModelSpec) -> range:
        """Global experts on this expert-parallel rank (empty range for dense models)."""
        if not spec.is_moe:
            return range(0)
        if spec.num_experts % self.ep:
            raise ValueError(f"ep={self.ep} does not divide num_experts={spec.num_experts}")
        n = spec.num_experts // self.ep
        return range(self.ep_rank * n, (self.ep_rank + 1) * n)

    @classmethod
    def from_parallel_state(cls) -> "RankLayout":
        """This process's layout, from megatron.core.parallel_state (after initialize_model_parallel)."""
        from megatron.core import parallel_state as ps

        return cls(tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                   pp=ps.get_pipeline_model_parallel_world_size(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                   ep=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank(),
                   etp=ps.get_expert_tensor_parallel_world_size(), etp_rank=ps.get_expert_tensor_parallel_rank())


def _shift(name: str, pattern: re.Pattern, offset: int) -> str:
    m = pattern.search(name)
    if m is None:
        return name
    return name[: m.start(1)] + str(int(m.group(1)) + offset) + name[m.end(1):]


def local_to_global_name(local_name: str, layout: RankLayout, spec: ModelSpec) -> str:
    """Canonical global name of a parameter named `local_name` on the rank `layout`."""
    name = canonical_name(local_name)
    name = _shift(name, _LAYER, layout.layer_range(spec).start)
    if _EXPERT.search(name):
        name = _shift(name, _EXPERT, layout.expert_range(spec).start)
    return name


def global_to_local_name(global_name: str, layout: RankLayout, spec: ModelSpec) -> str | None:
    """Canonical local name of `global_name` on rank `layout`, or None if that rank does not hold it."""
    name = canonical_name(global_name)
    if name.startswith("embedding."):
        return name if layout.is_first_stage else None
    if name.startswith(("decoder.final_layernorm.", "value_head.")):
        return name if layout.is_last_stage else None
    if name.startswith("output_layer."):
        # A tied actor with one stage reads the head from the embedding: no separate tensor.
        tied_here = spec.tie_word_embeddings and layout.is_first_stage
        return name if layout.is_last_stage and not tied_here else None
    m = _LAYER.search(name)
    if m is None:
        raise ValueError(f"not a Megatron GPT parameter name: {global_name!r}")
    layers = layout.layer_range(spec)
    if int(m.group(1)) not in layers:
        return None
    name = _shift(name, _LAYER, -layers.start)
    e = _EXPERT.search(name)
    if e is not None:
        experts = layout.expert_range(spec)
        if int(e.group(1)) not in experts:
            return None
        name = _shift(name, _EXPERT, -experts.start)
    return name


@dataclass(frozen=True)
class TPSplit:
    """How a full tensor is split over tensor parallelism."""

    dim: int | None  # None = replicated
    glu: bool = False  # dim-0 split of [gate; up] as [gate_r; up_r]
    expert: bool = False  # split over the expert-TP group instead of TP
    vocab: bool = False  # vocabulary rows: padded to padded_vocab_size(V, TP) before the split


def tp_partition(global_name: str, spec: ModelSpec) -> TPSplit:
    name = canonical_name(global_name)
    expert = ".mlp.experts.local_experts." in name
    if name.endswith("word_embeddings.weight") or name == "output_layer.weight":
        return TPSplit(0, vocab=True)
    if name.endswith("linear_qkv.weight"):
        return TPSplit(0)
    if name.endswith("linear_fc1.weight"):
        return TPSplit(0, glu=True, expert=expert)
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return TPSplit(1, expert=expert)
    if name.endswith(("layernorm.weight", "router.weight")) or name.startswith("value_head."):
        return TPSplit(None)
    raise ValueError(f"no tensor-parallel rule for parameter {global_name!r}")


def _sizes(layout: RankLayout, split: TPSplit) -> tuple[int, int]:
    return (layout.expert_tp, layout.expert_tp_rank) if split.expert else (layout.tp, layout.tp_rank)


def pad_vocab_rows(global_name: str, full: torch.Tensor, spec: ModelSpec, tp: int) -> torch.Tensor:
    """`full` with zero rows appended up to `padded_vocab_size(V, tp)` (vocab tensors only)."""
    if full.shape[0] != spec.vocab_size:
        raise ValueError(f"tensor {global_name} has {full.shape[0]} vocabulary rows, the config's vocab_size is "
                         f"{spec.vocab_size}")
    extra = padded_vocab_size(spec.vocab_size, tp) - spec.vocab_size
    return torch.cat([full, full.new_zeros((extra, *full.shape[1:]))]) if extra else full


def shard_tensor(global_name: str, full: torch.Tensor, layout: RankLayout, spec: ModelSpec) -> torch.Tensor:
    """This rank's TP shard of the full tensor `global_name` (a contiguous copy-free view if possible).

    Vocabulary tensors (embedding, LM head) are padded to `padded_vocab_size(V, TP)` rows first,
    even at TP 1, as the Megatron model is built with that many rows.
    """
    split = tp_partition(global_name, spec)
    size, rank = _sizes(layout, split)
    if split.vocab:
        full = pad_vocab_rows(global_name, full, spec, size)
    if split.dim is None or size == 1:
        return full
    if split.glu:
        if full.shape[0] % (2 * size):
            raise ValueError(f"tensor {global_name} dim 0 ({full.shape[0]}) not divisible by 2*tp={2 * size}")
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], dim=0)
    if full.shape[split.dim] % size:
        raise ValueError(f"tensor {global_name} dim {split.dim} ({full.shape[split.dim]}) not divisible by tp={size}")
    return full.chunk(size, dim=split.dim)[rank].contiguous()


def unshard_tensor(global_name: str, shards: Sequence[torch.Tensor], spec: ModelSpec) -> torch.Tensor:
    """Inverse of `shard_tensor`: the full tensor from all shards in TP-rank order.

    Replicated tensors return shard 0 (the others are assumed equal; callers that care can check).
    Vocabulary tensors lose their padding rows: the result has the config's vocab_size rows.
    """
    if not shards:
        raise ValueError(f"no shards given for tensor {global_name}")
    split = tp_partition(global_name, spec)
    if split.vocab:
        full = shards[0] if len(shards) == 1 else torch.cat(list(shards), dim=0)
        if full.shape[0] < spec.vocab_size:
            raise ValueError(f"tensor {global_name}: {len(shards)} shard(s) hold {full.shape[0]} vocabulary rows, "
                             f"fewer than the config's vocab_size {spec.vocab_size}")
        return full[: spec.vocab_size]
    if split.dim is None or len(shards) == 1:
        return shards[0]
    if split.glu:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(shards), dim=split.dim)
