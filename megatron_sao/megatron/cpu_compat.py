"""Run Megatron-Core on a CPU-only torch build (gloo), and its MoE on CUDA without TransformerEngine.

Megatron-Core assumes CUDA in a handful of places that have nothing to do with the math. Each patch
below names the call it fixes, so that the engineer who upgrades megatron-core can drop the ones that
are no longer needed. On a machine with CUDA `ensure_cpu_compat()` applies patches 5 and 9 only, and only
where TransformerEngine is absent (the local layer spec's fallback).

Patches (measured on megatron-core 0.16.1 and 0.19.2, torch 2.13 CPU; see
shared/reference/feasibility/megatron_cpu for the failures they fix):
1. torch.cuda.current_device() -> cpu: RotaryEmbedding moves inv_freq to the current CUDA device.
2. A TorchFunctionMode that maps device="cuda" (factories, .to, .cuda) to cpu: pipeline schedules,
   DDP buffers and optimizer code hard-code device="cuda".
3. torch.cuda Stream/Event/synchronize stubs: DDP grad sync, p2p communication, MoE dispatchers.
4. Tensor.type() reports "torch.cuda.*" names for CPU tensors: the distributed optimizer and grad
   clipping assert parameters are CUDA tensors by type name.
5. moe_utils.te_general_gemm = None: 0.16.1 leaves the name undefined without TransformerEngine, so
   every MoE router forward raises NameError, on CUDA as on CPU (`ensure_no_te_compat`).
6. token_dispatcher.maybe_move_tensor_to_cpu: CPU split sizes must become numpy for all_to_all.
7. tensor_parallel.random._get/_set_cuda_rng_state -> the CPU generator: activation recompute
   (parallel.recompute: full, CheckpointFunction) saves and restores the CUDA RNG state around
   every recomputed layer, which raises "Torch not compiled with CUDA enabled" on a CPU build.
8. fused_softmax.get_default_causal_mask -> cpu: the local spec's unfused softmax builds its causal
   mask (AttnMaskType.causal, attention_mask=None) on device="cuda". The TorchFunctionMode of
   patch 2 covers the forward pass, but not a forward replayed by activation recompute inside
   autograd's backward (the mode is not active there).
9. DistributedOptimizer._set_main_param_and_optimizer_states keeps the live "step": without TE and apex
   the distributed optimizer runs torch's Adam, whose per-parameter state holds "step" besides the
   moments. Loading a `fully_reshardable` checkpoint (megatron/optimizer_state.py) then fails in
   `load_parameter_state_from_fully_reshardable` -> `_set_main_param_and_optimizer_states` with
   KeyError: 'step': it copies every key of the destination state from the loaded tensors, and the
   loader leaves "step" out on purpose (it is restored from the param groups by `load_state_dict` just
   before). On CUDA as on CPU wherever TE and apex are absent (`ensure_no_te_compat`).
"""

from __future__ import annotations

import threading

import torch
from torch.overrides import TorchFunctionMode

_LOCK = threading.Lock()
_APPLIED: list[str] = []  # what was patched, in order (for logs and tests)
_CPU_PATCHED = False
_NO_TE_PATCHED = False


def _is_cuda(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return False


class _CudaToCpuMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


class _NullStream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def record_event(self, *a, **k):
        return _NullEvent()

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class _NullEvent:
    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


_MODE: _CudaToCpuMode | None = None


def _patch_torch_cuda() -> None:
    global _MODE
    torch.cuda.current_device = lambda: torch.device("cpu")
    _APPLIED.append("torch.cuda.current_device -> cpu")

    # The mode is entered on the importing thread and stays for the life of the process: every
    # Megatron call that builds a tensor on "cuda" must land on the CPU, including inside autograd.
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    _APPLIED.append("TorchFunctionMode device='cuda' -> cpu")

    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullEvent
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.default_stream = lambda *a, **k: _NullStream()
    torch.cuda.stream = lambda s=None: _NullStream()
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    _APPLIED.append("torch.cuda stream/event/synchronize stubs")

    original_type = torch.Tensor.type

    def _type(self, *args, **kwargs):
        if not args and not kwargs:
            name = original_type(self)
            if self.device.type == "cpu" and name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch."):]
            return name
        return original_type(self, *args, **kwargs)

    torch.Tensor.type = _type
    _APPLIED.append("Tensor.type() -> torch.cuda.* names for CPU tensors")


def _patch_megatron() -> None:
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    original_move = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    _APPLIED.append("token_dispatcher.maybe_move_tensor_to_cpu: CPU tensors stay on CPU")

    import megatron.core.tensor_parallel.random as mp_random

    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)
    _APPLIED.append("tensor_parallel.random cuda rng state -> CPU generator (activation recompute)")

    import megatron.core.fusions.fused_softmax as fused_softmax

    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)
    _APPLIED.append("fused_softmax.get_default_causal_mask -> cpu")


def ensure_no_te_compat() -> bool:
    """Patches 5 and 9, wherever TransformerEngine is absent (CUDA or not); True if they were needed.

    megatron-core 0.16.1 imports `te_general_gemm` inside a try and defines no fallback name: the
    router's forward tests `te_general_gemm is not None` and so raises NameError without TE.
    """
    import megatron.core.transformer.moe.moe_utils as moe_utils

    global _NO_TE_PATCHED
    with _LOCK:
        if _NO_TE_PATCHED:
            return False
        _NO_TE_PATCHED = True
        needed = not hasattr(moe_utils, "te_general_gemm")
        if needed:
            moe_utils.te_general_gemm = None
            _APPLIED.append("moe_utils.te_general_gemm = None")
        return _patch_fully_reshardable_step() or needed


def _patch_fully_reshardable_step() -> bool:
    """Patch 9 (see the module docstring), where megatron's distributed optimizer runs torch's Adam."""
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return False
    cls = distrib_optimizer.DistributedOptimizer
    original = cls._set_main_param_and_optimizer_states

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}  # copied onto itself: the step load_state_dict set
        return original(self, model_param, tensors)

    cls._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    _APPLIED.append("DistributedOptimizer._set_main_param_and_optimizer_states keeps torch Adam's step")
    return True


def ensure_cpu_compat() -> bool:
    """Apply every patch once if CUDA is absent (on CUDA only the no-TE one). Returns True when the
    CPU path is active.

    Call it before importing/building any Megatron model. Idempotent and thread-safe.
    """
    ensure_no_te_compat()
    if torch.cuda.is_available():
        return False
    global _CPU_PATCHED
    with _LOCK:
        if not _CPU_PATCHED:
            _patch_torch_cuda()
            _patch_megatron()
            _CPU_PATCHED = True
    return True
