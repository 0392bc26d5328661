"""Weight gradients accumulated inside the GEMM, straight into Megatron's gradient buffer, on a CPU.

Megatron-Core keeps every gradient in one contiguous buffer (`param.main_grad`, what DDP reduces and
the optimizer reads). Without `gradient_accumulation_fusion` a linear layer's backward returns a fresh
[out, in] weight gradient, and DDP's hook adds it into `main_grad` and frees it: per weight and micro-
batch, an allocation the size of the weight and one more pass over it. With the fusion, the weight
gradient GEMM accumulates into `main_grad` itself (beta = 1) and hands autograd a dummy, which DDP's
hook skips (`grad_added_to_main_grad`; the embedding's weight, which the LM head shares, gets a zeroed
dummy so that its own gradient still goes through the hook: `LanguageModule.setup_embeddings_and_output_layer`
sets `zero_out_wgrad`). That is the path Megatron-LM trains on GPUs, through apex's
`fused_weight_gradient_mlp_cuda`; a CPU has no apex, and `addmm_` into `main_grad` is the same
operation in one torch call.

`enable_cpu_wgrad_accumulation()` installs that kernel where apex is absent and no CUDA device exists;
the engine then builds its models with `gradient_accumulation_fusion=True` (a model trained outside
DDP has no `main_grad` and keeps the default, False). On CUDA nothing changes: the TE or local spec's
own setting stands.
"""

from __future__ import annotations

import torch


class _AddmmWgrad:
    """`fused_weight_gradient_mlp_cuda`'s two calls: main_grad += grad_output^T @ input (2-D inputs)."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        if total_input.dtype == main_grad.dtype:
            main_grad.addmm_(grad_output.t(), total_input)
        else:  # bf16 weights, fp32 buffer: torch's CPU GEMM takes one dtype; the unfused path's numerics
            main_grad.add_(grad_output.t() @ total_input)

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32  # a bf16 / fp16 buffer: the same call


def enable_cpu_wgrad_accumulation() -> bool:
    """Install the CPU kernel when neither CUDA nor apex's is there; True when the engine may then build
    its models with `gradient_accumulation_fusion=True`."""
    if torch.cuda.is_available():
        return False
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = _AddmmWgrad
        layers._grad_accum_fusion_available = True
    return True
