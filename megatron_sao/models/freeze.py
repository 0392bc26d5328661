"""Freeze parameters by name pattern (SAO's critic keeps its attention frozen during RL).

Patterns are matched against *canonical* parameter names (see
`megatron_sao.models.names.canonical_name`), so one preset works for the local and the TE
layer spec. A pattern is an fnmatch glob, or a regular expression when prefixed with "re:".

The critic preset (the paper's frozen-attention critic: "freeze attention, train only the MoE
projections") is four named groups, `CRITIC_FREEZE_GROUPS`, all frozen by default
(`config.PAPER_CRITIC_FREEZE`); `critic.freeze` lists group names and/or raw patterns:
- attention: q/k/v/o and the q/k norms, plus the input layernorm: it only feeds attention, and
  with the TE spec it is physically part of `linear_qkv` (layer_norm_weight), so freezing it keeps
  both specs identical;
- embeddings: the word embeddings (311M parameters on Qwen3-30B-A3B) feed every frozen attention
  layer; training them would move the inputs the frozen layers were fitted to;
- router: frozen too. It is not an expert projection, and training it on the value loss re-routes
  tokens (a discrete change of which experts see what) and lets the critic's routing drift from the
  policy backbone it starts from, the instability frozen attention is there to avoid; 48 x 128 x 2048
  parameters on Qwen3-30B-A3B, so nothing is lost in capacity;
- norms: the pre-MLP and final norms, frozen for the same reason as the embeddings (one vector
  rescales the input of every expert or of the value head) at a negligible parameter count.
What trains: the expert projections (dense models: the MLP projections) and the value head.

Pipeline parallel: a pattern may match nothing on one stage (e.g. "decoder.final_layernorm.*"
on the first stage). Pass `allow_empty_on_this_rank=True` there and check globally with
`check_patterns_matched_globally`, which all-reduces the per-pattern match counts.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from megatron_sao.models.hf_config import ModelSpec
from megatron_sao.models.names import canonical_name

logger = logging.getLogger(__name__)

CRITIC_FROZEN_ATTENTION: tuple[str, ...] = (
    "decoder.layers.*.input_layernorm.weight",
    "decoder.layers.*.self_attention.linear_qkv.weight",
    "decoder.layers.*.self_attention.linear_proj.weight",
    "decoder.layers.*.self_attention.q_layernorm.weight",
    "decoder.layers.*.self_attention.k_layernorm.weight",
)

_QK_NORM_PATTERNS = CRITIC_FROZEN_ATTENTION[3:]


CRITIC_FREEZE_GROUPS: dict[str, tuple[str, ...]] = {
    "attention": CRITIC_FROZEN_ATTENTION,
    "embeddings": ("embedding.word_embeddings.weight",),
    "router": ("decoder.layers.*.mlp.router.*",),
    "norms": ("decoder.layers.*.pre_mlp_layernorm.weight", "decoder.final_layernorm.weight"),
}


def critic_frozen_attention_patterns(spec: ModelSpec) -> tuple[str, ...]:
    """`CRITIC_FROZEN_ATTENTION` for this model (without the q/k-norm patterns when it has none,
    e.g. Llama, since a pattern that matches nothing is an error)."""
    if spec.qk_layernorm:
        return CRITIC_FROZEN_ATTENTION
    return tuple(p for p in CRITIC_FROZEN_ATTENTION if p not in _QK_NORM_PATTERNS)


def critic_group_patterns(group: str, spec: ModelSpec | None = None) -> tuple[str, ...]:
    """The patterns of one `CRITIC_FREEZE_GROUPS` group for this model (all of them without a spec).

    Patterns the model cannot have are left out, since a pattern that matches nothing is an error:
    q/k norms without `qk_layernorm` (Llama), the router in a dense model.
    """
    if group not in CRITIC_FREEZE_GROUPS:
        raise ValueError(f"unknown critic freeze group {group!r}; known: {sorted(CRITIC_FREEZE_GROUPS)}")
    if spec is None:
        return CRITIC_FREEZE_GROUPS[group]
    if group == "attention":
        return critic_frozen_attention_patterns(spec)
    if group == "router" and not spec.is_moe:
        return ()
    return CRITIC_FREEZE_GROUPS[group]


def expand_freeze_entries(entries: Sequence[str], spec: ModelSpec | None = None) -> list[str]:
    """`critic.freeze` entries -> patterns: a group name expands for this model, anything else is
    taken as a pattern. Duplicates are dropped (order kept)."""
    out: list[str] = []
    for entry in entries:
        out.extend(critic_group_patterns(entry, spec) if entry in CRITIC_FREEZE_GROUPS else [entry])
    return list(dict.fromkeys(out))


@dataclass
class FreezeReport:
    """What `apply_freeze` did on this rank."""

    trainable_names: list[str] = field(default_factory=list)
    frozen_names: list[str] = field(default_factory=list)
    trainable_params: int = 0
    frozen_params: int = 0
    matches_per_pattern: dict[str, int] = field(default_factory=dict)

    def log_line(self) -> str:
        total = self.trainable_params + self.frozen_params
        return (f"params: {self.trainable_params:,} trainable, {self.frozen_params:,} frozen "
                f"({len(self.frozen_names)} tensors frozen, {total:,} total on this rank)")


def _compile(pattern: str):
    if pattern.startswith("re:"):
        rx = re.compile(pattern[3:])
        return lambda name: rx.search(name) is not None
    return lambda name: fnmatch.fnmatchcase(name, pattern)


def _named_parameters(model_chunks) -> Iterable[tuple[str, torch.nn.Parameter]]:
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            yield canonical_name(name), param


def apply_freeze(model_chunks, patterns: Sequence[str], *, allow_empty_on_this_rank: bool = False) -> FreezeReport:
    """Set requires_grad=False on every parameter whose canonical name matches a pattern.

    Call before building DDP/the optimizer (Megatron's DDP only allocates grad buffers for
    parameters that require grad). Raises ValueError naming any pattern that matches nothing,
    unless `allow_empty_on_this_rank` (then verify with `check_patterns_matched_globally`).
    Names are the local (per-rank) layer indices, so globs like "decoder.layers.*" are
    layer-agnostic; select specific global layers only via regexes on canonical names.
    """
    if isinstance(patterns, str):
        raise TypeError("patterns must be a sequence of strings, not a single string")
    matchers = [(p, _compile(p)) for p in patterns]
    report = FreezeReport(matches_per_pattern={p: 0 for p in patterns})
    for name, param in _named_parameters(model_chunks):
        hit = False
        for pattern, match in matchers:
            if match(name):
                report.matches_per_pattern[pattern] += 1
                hit = True
        if hit:
            param.requires_grad_(False)
        if param.requires_grad:
            report.trainable_names.append(name)
            report.trainable_params += param.numel()
        else:
            report.frozen_names.append(name)
            report.frozen_params += param.numel()
    empty = [p for p, n in report.matches_per_pattern.items() if n == 0]
    if empty and not allow_empty_on_this_rank:
        raise ValueError(f"freeze pattern(s) matched no parameter: {empty}")
    logger.info("freeze: %s", report.log_line())
    return report


def check_patterns_matched_globally(report: FreezeReport, group=None) -> None:
    """All-reduce per-pattern match counts; raise if a pattern matched nothing on every rank."""
    patterns = list(report.matches_per_pattern)
    counts = [report.matches_per_pattern[p] for p in patterns]
    if torch.distributed.is_initialized():
        from megatron_sao.distributed.devices import collective_device

        counts = torch.tensor(counts, dtype=torch.long, device=collective_device(group))
        torch.distributed.all_reduce(counts, group=group)
        counts = counts.tolist()
    empty = [p for p, c in zip(patterns, counts) if c == 0]
    if empty:
        raise ValueError(f"freeze pattern(s) matched no parameter on any rank: {empty}")
