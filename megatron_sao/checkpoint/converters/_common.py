"""Rule-table machinery shared by the per-architecture HF <-> Megatron converters.

A converter is a list of `Rule`s: one Megatron tensor <-> one or more HF tensors, with templates
containing {L} (global layer) and {E} (global expert). Rules that need more than a rename carry
a `merge` (HF -> Megatron) and `split` (Megatron -> HF) pair; the pair must be exact inverses
(the round-trip tests compare every tensor bit for bit). Tensors are never cast: dtypes pass
through unchanged.

Also here: the rules every Llama-family model shares (embedding, norms, q/k/v interleave, o_proj,
dense SwiGLU MLP, LM head and the critic's value head).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from megatron_sao.checkpoint.param_layout import expected_shape, full_param_shapes
from megatron_sao.models.hf_config import ModelSpec
from megatron_sao.models.names import canonical_name

Merge = Callable[[Sequence[torch.Tensor], ModelSpec], torch.Tensor]
Split = Callable[[torch.Tensor, ModelSpec], Sequence[torch.Tensor]]

# HF tensors that carry no weights the Megatron model needs.
_IGNORABLE_HF = re.compile(r"(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")


def _template_regex(template: str) -> re.Pattern:
    pattern = re.escape(template).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
    return re.compile("^" + pattern + "$")


@dataclass(frozen=True)
class Rule:
    mcore: str
    hf: tuple[str, ...]
    merge: Merge | None = None  # None: single HF tensor, renamed
    split: Split | None = None

    def __post_init__(self) -> None:
        if (self.merge is None) != (self.split is None) or (self.merge is None and len(self.hf) != 1):
            raise ValueError(f"rule for {self.mcore}: give merge and split together (required for >1 HF tensor)")


# --------------------------------------------------------------------------- layout transforms
def qkv_merge(tensors: Sequence[torch.Tensor], spec: ModelSpec) -> torch.Tensor:
    """HF q [NH*D, H], k/v [NG*D, H] -> Megatron linear_qkv, interleaved per query group:
    for each group g, its NH/NG query heads, then k_g, then v_g (a plain [q; k; v] concat gives
    logits that are wrong by O(1): tests/integration/megatron/test_models_equivalence.py)."""
    q, k, v = tensors
    ng, d, hpg = spec.num_kv_heads, spec.head_dim, spec.heads_per_group
    h = q.shape[-1]
    merged = torch.cat([q.reshape(ng, hpg * d, h), k.reshape(ng, d, h), v.reshape(ng, d, h)], dim=1)
    return merged.reshape(ng * (hpg + 2) * d, h)


def qkv_split(qkv: torch.Tensor, spec: ModelSpec) -> list[torch.Tensor]:
    ng, d, hpg = spec.num_kv_heads, spec.head_dim, spec.heads_per_group
    h = qkv.shape[-1]
    q, k, v = torch.split(qkv.reshape(ng, (hpg + 2) * d, h), [hpg * d, d, d], dim=1)
    return [q.reshape(ng * hpg * d, h).contiguous(), k.reshape(ng * d, h).contiguous(),
            v.reshape(ng * d, h).contiguous()]


def glu_merge(tensors: Sequence[torch.Tensor], spec: ModelSpec) -> torch.Tensor:
    """HF gate_proj, up_proj -> Megatron linear_fc1 rows [gate; up] (Megatron applies the
    activation to the first half)."""
    gate, up = tensors
    return torch.cat([gate, up], dim=0)


def glu_split(fc1: torch.Tensor, spec: ModelSpec) -> list[torch.Tensor]:
    gate, up = fc1.chunk(2, dim=0)
    return [gate.contiguous(), up.contiguous()]


# --------------------------------------------------------------------------- shared rules
def llama_family_rules(*, qk_norm: bool, dense_mlp: bool) -> list[Rule]:
    p = "model.layers.{L}."
    m = "decoder.layers.{L}."
    rules = [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
        Rule("output_layer.weight", ("lm_head.weight",)),
        # Critic value head: verl-style AutoModelForTokenClassification(num_labels=1) name.
        Rule("value_head.weight", ("score.weight",)),
        Rule("value_head.bias", ("score.bias",)),
        Rule(m + "input_layernorm.weight", (p + "input_layernorm.weight",)),
        Rule(m + "pre_mlp_layernorm.weight", (p + "post_attention_layernorm.weight",)),
        Rule(m + "self_attention.linear_qkv.weight",
             (p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
             qkv_merge, qkv_split),
        Rule(m + "self_attention.linear_proj.weight", (p + "self_attn.o_proj.weight",)),
    ]
    if qk_norm:
        rules += [Rule(m + "self_attention.q_layernorm.weight", (p + "self_attn.q_norm.weight",)),
                  Rule(m + "self_attention.k_layernorm.weight", (p + "self_attn.k_norm.weight",))]
    if dense_mlp:
        rules += [Rule(m + "mlp.linear_fc1.weight", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                       glu_merge, glu_split),
                  Rule(m + "mlp.linear_fc2.weight", (p + "mlp.down_proj.weight",))]
    return rules


# --------------------------------------------------------------------------- the converter
class RuleConverter:
    """HF <-> Megatron conversion for one architecture, driven by a rule table."""

    def __init__(self, arch: str, rules: Sequence[Rule],
                 preprocess_hf: Callable[[Mapping[str, torch.Tensor], ModelSpec],
                                         Mapping[str, torch.Tensor]] | None = None):
        self.arch = arch
        self.rules = list(rules)
        self._compiled = [(_template_regex(r.mcore), r) for r in self.rules]
        self._preprocess_hf = preprocess_hf

    def _check_arch(self, spec: ModelSpec) -> None:
        if spec.arch != self.arch:
            raise ValueError(f"{self.arch} converter used with a {spec.arch} ModelSpec")

    def _match(self, global_name: str) -> tuple[Rule, dict[str, str]]:
        for rx, rule in self._compiled:
            m = rx.match(global_name)
            if m:
                return rule, m.groupdict()
        raise ValueError(f"{self.arch}: no HF mapping for Megatron parameter {global_name!r}")

    def hf_names(self, global_name: str, spec: ModelSpec) -> list[str]:
        """HF tensor names that make up one canonical global Megatron tensor."""
        rule, idx = self._match(canonical_name(global_name))
        return [t.format(**idx) for t in rule.hf]

    def to_mcore(self, global_name: str, hf_state: Mapping[str, torch.Tensor], spec: ModelSpec) -> torch.Tensor:
        """One full Megatron tensor from the HF tensors it is made of (read lazily from hf_state)."""
        rule, idx = self._match(global_name)
        names = [t.format(**idx) for t in rule.hf]
        missing = [n for n in names if n not in hf_state]
        if missing:
            raise ValueError(f"missing HF tensor(s) {missing} (needed for Megatron {global_name})")
        tensors = [hf_state[n] for n in names]
        try:
            out = tensors[0] if rule.merge is None else rule.merge(tensors, spec)
        except RuntimeError as exc:  # a reshape that does not fit the config
            shapes = {n: tuple(t.shape) for n, t in zip(names, tensors)}
            raise ValueError(f"HF tensor shapes {shapes} do not fit the config for Megatron {global_name}: "
                             f"{exc}") from None
        want = expected_shape(global_name, spec)
        if tuple(out.shape) != want:
            shapes = {n: tuple(t.shape) for n, t in zip(names, tensors)}
            raise ValueError(f"HF tensor(s) {shapes} give Megatron {global_name} shape {tuple(out.shape)}, "
                             f"config expects {want}")
        return out

    def infer_role(self, hf_names: Sequence[str] | Mapping) -> str:
        return "critic" if "score.weight" in hf_names else "actor"

    def hf_to_mcore(self, hf_state: Mapping[str, torch.Tensor], spec: ModelSpec, role: str | None = None,
                    *, strict: bool = True) -> dict[str, torch.Tensor]:
        """Full (unsharded) canonical Megatron state dict from an HF state dict (on-disk names).

        role None: "critic" if the HF state has score.weight, else "actor". strict: HF tensors
        that no Megatron tensor uses raise (a sign of a wrong architecture), except the LM head
        of a tied model and the LM head when building a critic.
        """
        self._check_arch(spec)
        if self._preprocess_hf is not None:
            hf_state = self._preprocess_hf(hf_state, spec)
        role = role or self.infer_role(hf_state)
        out = {name: self.to_mcore(name, hf_state, spec) for name in full_param_shapes(spec, role)}
        if strict:
            used = {n for name in out for n in self.hf_names(name, spec)}
            unused = [k for k in hf_state if k not in used and not _IGNORABLE_HF.search(k)
                      and not (k == "lm_head.weight" and (spec.tie_word_embeddings or role == "critic"))]
            if unused:
                raise ValueError(f"HF tensor(s) not used by the {self.arch} {role} mapping: {unused[:5]}")
        return out

    def mcore_to_hf(self, global_name: str, tensor: torch.Tensor, spec: ModelSpec) -> list[tuple[str, torch.Tensor]]:
        """HF (name, tensor) pairs of one full Megatron parameter; [] for a tied actor's output
        layer (HF reads the head from model.embed_tokens.weight)."""
        self._check_arch(spec)
        name = canonical_name(global_name)
        if name == "output_layer.weight" and spec.tie_word_embeddings:
            return []
        want = expected_shape(name, spec)
        if tuple(tensor.shape) != want:
            raise ValueError(f"Megatron tensor {name} has shape {tuple(tensor.shape)}, config expects {want}")
        rule, idx = self._match(name)
        names = [t.format(**idx) for t in rule.hf]
        parts = [tensor] if rule.split is None else rule.split(tensor, spec)
        return list(zip(names, parts))
