"""Write HF-named tensors into a live torch model, all or nothing.

The trainer exports weights under HF *checkpoint* names (what safetensors files and vLLM use). A
transformers 5.x model does not always hold parameters under those names: Qwen3-MoE (and other MoE
models) keep the experts of a layer fused in memory as ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate
rows first, then up) and ``mlp.experts.down_proj [E, H, I]``, while the checkpoint has
``mlp.experts.{e}.gate_proj.weight [I, H]``, ``...up_proj.weight [I, H]`` and ``...down_proj.weight [H, I]``.
``WeightTargets`` maps both spellings onto views of the live parameters, so an update can use either.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

_FUSED_GATE_UP = re.compile(r"^(?P<prefix>.*\.experts)\.gate_up_proj$")
_FUSED_DOWN = re.compile(r"^(?P<prefix>.*\.experts)\.down_proj$")
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class _Target:
    """A destination: ``param.data[index]`` (index ``()`` = the whole parameter)."""

    param: torch.Tensor
    index: tuple

    def view(self) -> torch.Tensor:
        return self.param.data[self.index] if self.index else self.param.data


class WeightTargets:
    """Resolve HF names (checkpoint or in-memory spelling) to views of a model's parameters."""

    def __init__(self, model: nn.Module) -> None:
        # remove_duplicate=False so a tied lm_head.weight resolves to the embedding it shares.
        self._params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        self._params.update(dict(model.named_buffers(remove_duplicate=False)))
        # Fused expert tensors, keyed by the "...experts" prefix, so per-expert names resolve lazily.
        self._gate_up: dict[str, torch.Tensor] = {}
        self._down: dict[str, torch.Tensor] = {}
        for name, p in self._params.items():
            if p.dim() == 3 and (m := _FUSED_GATE_UP.match(name)):
                self._gate_up[m["prefix"]] = p
            elif p.dim() == 3 and (m := _FUSED_DOWN.match(name)):
                self._down[m["prefix"]] = p

    def resolve(self, name: str) -> _Target | None:
        """The target for ``name``, or None if the model has no such weight."""
        if name in self._params:
            return _Target(self._params[name], ())
        m = _PER_EXPERT.match(name)
        if m is None:
            return None
        prefix, e, proj = m["prefix"], int(m["e"]), m["proj"]
        if proj == "down_proj":
            fused = self._down.get(prefix)
            if fused is None or e >= fused.shape[0]:
                return None
            return _Target(fused, (e,))
        fused = self._gate_up.get(prefix)
        if fused is None or e >= fused.shape[0]:
            return None
        inter = fused.shape[1] // 2
        rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
        return _Target(fused, (e, rows))


def plan_update(
    targets: WeightTargets, buckets: Iterable[list[tuple[str, torch.Tensor]]], *, owner: str = "model",
    seen: set[str] | None = None,
) -> list[tuple[_Target, torch.Tensor]]:
    """Validate a whole update before anything is written; return (target, tensor) pairs to copy.

    Raises KeyError for unknown names (listing up to 5 of them), ValueError for shape mismatches,
    duplicated names or non-tensor values. Nothing is modified here, so a failed update leaves the
    model exactly as it was. ``seen`` carries the names of earlier buckets of a streamed update.
    """
    plan: list[tuple[_Target, torch.Tensor]] = []
    unknown: list[str] = []
    seen = set() if seen is None else seen
    for b, bucket in enumerate(buckets):
        for item in bucket:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise ValueError(f"{owner}: bucket {b} holds {type(item).__name__}, expected (name, tensor) pairs")
            name, tensor = item
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{owner}: weight {name!r} is a {type(tensor).__name__}, expected torch.Tensor")
            if name in seen:
                raise ValueError(f"{owner}: weight {name!r} appears twice in one update")
            seen.add(name)
            target = targets.resolve(name)
            if target is None:
                unknown.append(name)
                continue
            want = tuple(target.view().shape)
            if tuple(tensor.shape) != want:
                raise ValueError(f"{owner}: weight {name!r} has shape {tuple(tensor.shape)}, the model expects {want}")
            if tensor.is_floating_point() != target.param.is_floating_point():
                raise ValueError(f"{owner}: weight {name!r} has dtype {tensor.dtype}, "
                                 f"the model holds {target.param.dtype}")
            plan.append((target, tensor))
    if unknown:
        raise KeyError(f"{owner}: {len(unknown)} unknown weight name(s), e.g. {unknown[:5]}")
    return plan


@torch.no_grad()
def apply_update(plan: list[tuple[_Target, torch.Tensor]]) -> int:
    """Copy a validated plan in place (dtype/device converted); return the number of bytes received."""
    nbytes = 0
    for target, tensor in plan:
        target.view().copy_(tensor)
        nbytes += tensor.numel() * tensor.element_size()
    return nbytes
