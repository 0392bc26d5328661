"""Trainable / frozen parameter counts per group of the whole model (all ranks), for the log.

Each rank lists its parameters under their global canonical names with the size of the *full*
tensor (its local shard times the tensor-parallel split, see `checkpoint.sharding`); the lists of
all ranks are merged by name, so data-parallel and tensor-parallel replicas count once and pipeline
stages and expert-parallel ranks add up. One `all_gather_object` of a few thousand names.
"""

from __future__ import annotations

import torch

from megatron_sao.checkpoint.sharding import RankLayout, local_to_global_name, tp_partition
from megatron_sao.models.hf_config import ModelSpec
from megatron_sao.models.names import canonical_name
from megatron_sao.models.vocab import padded_vocab_size

# (group, name fragments that put a canonical name into it), first match wins.
_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("embeddings", ("embedding.",)),
    ("attention", (".self_attention.", ".input_layernorm.")),
    ("router", (".mlp.router.",)),
    ("experts", (".mlp.experts.", ".mlp.shared_experts.")),
    ("mlp", (".mlp.linear_fc",)),
    ("norms", ("pre_mlp_layernorm.", "final_layernorm.")),
    ("value_head", ("value_head.",)),
    ("output_layer", ("output_layer.",)),
)


def param_group(name: str) -> str:
    """The group of a canonical parameter name ("other" if none fits)."""
    name = canonical_name(name)
    for group, fragments in _GROUPS:
        if any(f in name or name.startswith(f) for f in fragments):
            return group
    return "other"


def _full_numel(global_name: str, local_numel: int, spec: ModelSpec, layout: RankLayout) -> int:
    try:
        split = tp_partition(global_name, spec)
    except ValueError:  # a tensor without a sharding rule is replicated
        return local_numel
    if split.dim is None:
        return local_numel
    full = local_numel * (layout.expert_tp if split.expert else layout.tp)
    if split.vocab:  # the model holds padded vocabulary rows (models/vocab.py); count the real ones
        full = full // padded_vocab_size(spec.vocab_size, layout.tp) * spec.vocab_size
    return full


def local_param_table(model_chunks, spec: ModelSpec, layout: RankLayout) -> dict[str, tuple[int, bool]]:
    """{global canonical name: (full numel, trainable)} of the parameters on this rank."""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    table: dict[str, tuple[int, bool]] = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            global_name = local_to_global_name(name, layout, spec)
            table[global_name] = (_full_numel(global_name, param.numel(), spec, layout), param.requires_grad)
    return table


def counts_by_group(table: dict[str, tuple[int, bool]]) -> dict[str, dict[str, int]]:
    """{group: {"trainable": n, "frozen": n}} summed over a merged table, groups in a fixed order."""
    order = [g for g, _ in _GROUPS] + ["other"]
    out: dict[str, dict[str, int]] = {}
    for name, (numel, trainable) in table.items():
        entry = out.setdefault(param_group(name), {"trainable": 0, "frozen": 0})
        entry["trainable" if trainable else "frozen"] += numel
    return {g: out[g] for g in order if g in out}


def param_counts_by_group(model_chunks, spec: ModelSpec, layout: RankLayout) -> dict[str, dict[str, int]]:
    """Whole-model counts per group. Collective when torch.distributed is initialised: every rank
    must call it (every rank gets the result)."""
    table = local_param_table(model_chunks, spec, layout)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        tables: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(tables, table)
        table = {k: v for t in tables for k, v in t.items()}
    return counts_by_group(table)


def format_param_counts(counts: dict[str, dict[str, int]]) -> str:
    """One line: "experts 1,234 trainable; embeddings 311 frozen; ... (total: X trainable, Y frozen)"."""
    parts = []
    for group, c in counts.items():
        kinds = [f"{c[k]:,} {k}" for k in ("trainable", "frozen") if c[k]]
        parts.append(f"{group} {' + '.join(kinds) if kinds else '0'}")
    trainable = sum(c["trainable"] for c in counts.values())
    frozen = sum(c["frozen"] for c in counts.values())
    return f"{'; '.join(parts)} (total {trainable:,} trainable, {frozen:,} frozen)"
