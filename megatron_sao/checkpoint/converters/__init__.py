"""Per-architecture HF <-> Megatron-Core converters (one module per architecture).

Each module exposes `ARCH`, `CONVERTER` (a `RuleConverter`) and the two functions
`hf_to_mcore(hf_state, spec, role=None) -> dict` (full, unsharded canonical Megatron names) and
`mcore_to_hf(global_name, tensor, spec) -> list[(hf_name, tensor)]` (streaming, one parameter
at a time, used by the engine's bucketed weight export).
"""

from __future__ import annotations

from megatron_sao.checkpoint.converters import llama, qwen3, qwen3_moe
from megatron_sao.checkpoint.converters._common import RuleConverter
from megatron_sao.models.hf_config import ModelSpec

_REGISTRY: dict[str, RuleConverter] = {m.ARCH: m.CONVERTER for m in (qwen3_moe, qwen3, llama)}


def get_converter(spec: ModelSpec | str) -> RuleConverter:
    """The converter for `spec.arch` (or an arch string); ValueError for an unsupported one."""
    arch = spec if isinstance(spec, str) else spec.arch
    try:
        return _REGISTRY[arch]
    except KeyError:
        raise ValueError(f"no HF <-> Megatron converter for architecture {arch!r}; "
                         f"supported: {', '.join(sorted(_REGISTRY))}") from None


__all__ = ["get_converter", "RuleConverter"]
