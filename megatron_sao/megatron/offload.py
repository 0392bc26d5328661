"""A trainer model's state to host memory and back, on Megatron-Core's real buffers (colocated placement).

Colocated rollouts share each GPU between a trainer rank and a vLLM shard; while the engine
generates, the trainer must hold no GPU memory it does not need. Three parts move, each a set of
unique tensor *storages* collected when it is offloaded:

  params     every storage behind the module's parameters: DDP's contiguous param buffers (with the
             distributed optimizer every parameter is a view into them) and the parameters outside
             them (frozen ones: DDP buffers only what trains). Copied to host, then released.
  grads      DDP's grad buffers (every ``param.main_grad`` is a view into them): released without a
             copy and re-allocated zeroed, as megatron-core's own ``offload_grad_buffers`` does;
             ``train_step`` zeroes them before it accumulates anyway. The optimizer's main-parameter
             ``.grad`` (fp32 copies under bf16) is dropped.
  optimizer  the optimizer's main parameters (the fp32 master copy of bf16 weights) and every state
             tensor (Adam m, v, step), except storages that are parameters: the fp32 distributed
             optimizer's main parameters are views into the param buffer and move with ``params``.

Release = ``untyped_storage().resize_(0)``; restore = ``resize_(nbytes)`` and copy back. Every tensor
object (bucket views, ``main_grad``, optimizer shards, state) stays the same object, so nothing that
holds a reference needs rebuilding; verl's Megatron offload and megatron-core's grad-buffer offload
work the same way. megatron-core 0.16.1's other helpers are not used: ``_ParamAndGradBuffer.
offload_to_cpu`` copies with ``param_data.cpu()``, which on a CPU build returns the buffer itself (the
release would then destroy the "copy"), and ``MegatronOptimizer.offload_to_cpu`` rebinds ``.data`` of
CUDA tensors only, which breaks the aliasing above and never runs on a CPU build.

A released tensor must not be touched (on a CPU build reading one segfaults, on a GPU it reads freed
memory): ``MegatronEngine`` checks ``resident`` before every call that reads its state.
On CUDA the host copies are pinned and kept for the next cycle (pinning is slow); on a CPU build they
are freed at restore, so the round trip costs no memory at rest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

PARTS = ("params", "grads", "optimizer")


@dataclass
class _Moved:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # uint8 copy (None: released without a copy, restored as zeros)


@dataclass
class OffloadFigures:
    """What one offload/onload call moved: bytes per part and seconds."""

    bytes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


def _bytes_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TrainerOffload:
    """Offload and restore one engine's parts (see the module docstring). Idempotent per part."""

    def __init__(self, ddp, optimizer, device: torch.device) -> None:
        self.ddp, self.optimizer = ddp, optimizer
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self._moved: dict[str, list[_Moved]] = {}
        self._spare: dict[int, torch.Tensor] = {}  # pinned host copies kept for the next cycle (CUDA)

    # ------------------------------------------------------------------ what is where
    def resident(self, *parts: str) -> bool:
        return not any(p in self._moved for p in (parts or PARTS))

    def offloaded(self) -> list[str]:
        return [p for p in PARTS if p in self._moved]

    def device_bytes(self) -> dict[str, int]:
        """Bytes each part holds on the device now (0 for an offloaded part)."""
        return {p: 0 if p in self._moved else sum(s.nbytes() for s in self._storages(p)) for p in PARTS}

    # ------------------------------------------------------------------ the storages of each part
    def _on_device(self, s: torch.UntypedStorage) -> bool:
        return s.nbytes() > 0 and s.device.type == self.device.type

    def _unique(self, tensors, exclude: set[int] = frozenset()) -> list[torch.UntypedStorage]:
        out, seen = [], set(exclude)
        for t in tensors:
            s = t.untyped_storage()
            if s._cdata not in seen and self._on_device(s):
                seen.add(s._cdata)
                out.append(s)
        return out

    def _param_tensors(self):
        return list(self.ddp.module.parameters())

    def _grad_tensors(self):
        buffers = list(getattr(self.ddp, "buffers", [])) + list(getattr(self.ddp, "expert_parallel_buffers", []))
        return [b.grad_data for b in buffers if getattr(b, "grad_data", None) is not None]

    def _inner_optimizers(self):
        from megatron_sao.megatron.optimizer import sub_optimizers

        return [o.optimizer for o in sub_optimizers(self.optimizer) if getattr(o, "optimizer", None) is not None]

    def _optimizer_tensors(self):
        out = []
        for inner in self._inner_optimizers():
            out += [p for g in inner.param_groups for p in g["params"] if isinstance(p, torch.Tensor)]
            out += [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        return out

    def _storages(self, part: str) -> list[torch.UntypedStorage]:
        if part == "params":
            return self._unique(self._param_tensors())
        if part == "grads":
            return self._unique(self._grad_tensors())
        if part == "optimizer":
            taken = {t.untyped_storage()._cdata for t in self._param_tensors() + self._grad_tensors()}
            return self._unique(self._optimizer_tensors(), exclude=taken)
        raise ValueError(f"unknown trainer part {part!r}; parts are {PARTS}")

    # ------------------------------------------------------------------ moving
    def _host_for(self, s: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
        host = self._spare.pop(s._cdata, None)
        if host is None or host.numel() != nbytes:
            host = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self.pin)
        return host

    @torch.no_grad()
    def offload(self, parts) -> OffloadFigures:
        """Release ``parts`` from the device (params and optimizer copied to host first)."""
        t0, fig = time.perf_counter(), OffloadFigures()
        todo = [p for p in parts if p not in self._moved]
        for part in todo:
            if part == "grads":
                for inner in self._inner_optimizers():
                    for g in inner.param_groups:
                        for p in g["params"]:
                            p.grad = None
            moved = []
            for s in self._storages(part):
                n = s.nbytes()
                host = None
                if part != "grads":
                    host = self._host_for(s, n)
                    host.copy_(_bytes_view(s, n))  # blocking: the copy must finish before the release
                moved.append(_Moved(s, n, host))
            _sync(self.device)
            for m in moved:
                m.storage.resize_(0)
            self._moved[part] = moved
            fig.bytes[part] = sum(m.nbytes for m in moved)
        if todo and self.device.type == "cuda":
            torch.cuda.empty_cache()  # give the memory back to the driver: vLLM allocates outside torch's cache
        fig.seconds = time.perf_counter() - t0
        return fig

    @torch.no_grad()
    def onload(self, parts) -> OffloadFigures:
        """Re-allocate ``parts`` on the device and restore their bytes (grads: zeros)."""
        t0, fig = time.perf_counter(), OffloadFigures()
        for part in [p for p in parts if p in self._moved]:
            moved = self._moved.pop(part)
            for m in moved:
                m.storage.resize_(m.nbytes)
                view = _bytes_view(m.storage, m.nbytes)
                if m.host is None:
                    view.zero_()
                else:
                    view.copy_(m.host, non_blocking=self.pin)
            _sync(self.device)
            if self.pin:
                self._spare.update({m.storage._cdata: m.host for m in moved if m.host is not None})
            fig.bytes[part] = sum(m.nbytes for m in moved)
        fig.seconds = time.perf_counter() - t0
        return fig
