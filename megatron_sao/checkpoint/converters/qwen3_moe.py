"""Qwen3-MoE (Qwen3MoeForCausalLM, e.g. Qwen3-30B-A3B): Qwen3 attention, every layer an MoE.

HF (on disk, and what vLLM's load_weights takes)    Megatron-Core (local spec)
mlp.gate.weight [E, H]                               mlp.router.weight
mlp.experts.E.gate_proj / up_proj [I, H]             mlp.experts.local_experts.E.linear_fc1.weight [2I, H] = [gate; up]
mlp.experts.E.down_proj [H, I]                       mlp.experts.local_experts.E.linear_fc2.weight

transformers 5.x keeps the experts of a loaded model fused in memory (mlp.experts.gate_up_proj
[E, 2I, H] with gate rows first, mlp.experts.down_proj [E, H, I]) and writes per-expert names
to disk. `hf_to_mcore` accepts both: fused in-memory names are split into on-disk names first.
`mcore_to_hf` always produces on-disk names.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

from megatron_sao.checkpoint.converters._common import Rule, RuleConverter, glu_merge, glu_split, llama_family_rules
from megatron_sao.models.hf_config import ModelSpec

ARCH = "qwen3_moe"

_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)$")


def unfuse_experts(hf_state: Mapping[str, torch.Tensor], spec: ModelSpec) -> Mapping[str, torch.Tensor]:
    """Per-expert on-disk names from transformers 5.x fused in-memory expert tensors (views, no copy).

    A state without fused names is returned as is (so lazy on-disk readers stay lazy)."""
    if not any(_FUSED.match(k) for k in hf_state):
        return hf_state
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state.items():
        m = _FUSED.match(name)
        if m is None:
            out[name] = tensor
            continue
        prefix, kind = m.groups()
        if tensor.dim() != 3 or tensor.shape[0] != spec.num_experts:
            raise ValueError(f"HF tensor {name} has shape {tuple(tensor.shape)}, expected [num_experts="
                             f"{spec.num_experts}, ...]")
        for e in range(spec.num_experts):
            if kind == "down_proj":
                out[f"{prefix}{e}.down_proj.weight"] = tensor[e]
            else:
                gate, up = tensor[e].chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"] = gate
                out[f"{prefix}{e}.up_proj.weight"] = up
    return out


def _rules() -> list[Rule]:
    p, m = "model.layers.{L}.", "decoder.layers.{L}."
    x, y = p + "mlp.experts.{E}.", m + "mlp.experts.local_experts.{E}."
    return llama_family_rules(qk_norm=True, dense_mlp=False) + [
        Rule(m + "mlp.router.weight", (p + "mlp.gate.weight",)),
        Rule(y + "linear_fc1.weight", (x + "gate_proj.weight", x + "up_proj.weight"), glu_merge, glu_split),
        Rule(y + "linear_fc2.weight", (x + "down_proj.weight",)),
    ]


CONVERTER = RuleConverter(ARCH, _rules(), preprocess_hf=unfuse_experts)
hf_to_mcore = CONVERTER.hf_to_mcore
mcore_to_hf = CONVERTER.mcore_to_hf
