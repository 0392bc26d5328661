"""The MoE router runs on CUDA without TransformerEngine (the local layer spec's fallback).

megatron-core 0.16.1 defines `moe_utils.te_general_gemm` only when TransformerEngine imports, and the
router's gating GEMM tests `te_general_gemm is not None`: without TE every MoE forward raises
NameError, on a GPU box as on a CPU. `ensure_cpu_compat()` used to patch that only when CUDA was
absent. Here a fresh interpreter is told CUDA is present (torch.cuda.is_available -> True): the
no-TE patch must apply, the CPU-only patches must not, and the router's gating GEMM must run.
"""

import subprocess
import sys

PROBE = r"""
import torch
torch.cuda.is_available = lambda: True  # a CUDA machine without TransformerEngine
import megatron.core.transformer.moe.moe_utils as moe_utils
assert not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm")
x, w = torch.randn(5, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
try:
    moe_utils.router_gating_linear(x.float(), w.float(), None, torch.float32)
    raise SystemExit("the router GEMM ran without the patch: this test no longer tests anything")
except NameError:
    pass
from megatron_sao.megatron import cpu_compat
assert cpu_compat.ensure_cpu_compat() is False  # the CUDA path: no CPU patches
assert moe_utils.te_general_gemm is None
assert cpu_compat._APPLIED == ["moe_utils.te_general_gemm = None",
                             "DistributedOptimizer._set_main_param_and_optimizer_states keeps torch Adam's step"], \
    cpu_compat._APPLIED
out = moe_utils.router_gating_linear(x.float(), w.float(), None, torch.float32)
assert torch.allclose(out.double(), x @ w.t(), atol=1e-5)
print("ok")
"""


def test_the_no_te_patch_applies_on_cuda_and_the_router_runs():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
