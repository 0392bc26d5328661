"""Where a train step's time goes, by phase, on the engine's Megatron model and on the plain HF model alike
(`bench_step_overhead.py --phases`).

Forward hooks time each module's forward (pre-hook to hook). For the backward, a gradient hook on the
module's output fires when its backward starts and one on its input when it ends; on a CPU the autograd
engine runs the backward on the calling thread, one node at a time, so those intervals do not overlap
and what lies outside them is the rest of the backward (residual adds, the embedding's gradient, the
gradient buffer's accumulation, the schedule). The phases are named once for both models, by the
module's role in a Llama layer, so the two columns compare like with like:

    embedding, norms, attention (projections, RoPE and the attention kernel), mlp, head (LM head or
    value head), loss (from the head's output to the loss: the log-prob / entropy pass and the loss
    function), loss backward (from the backward's start to the head's backward), backward other,
    optimizer (everything after the forward-backward: clipping, the update, and the engine's bookkeeping)

The hooks cost a little on both sides alike: the phases' figures come from their own rounds, never
from the rounds that give the ratios.
"""

from __future__ import annotations

import torch

PHASES = ("embedding", "norms", "attention", "mlp", "head", "loss", "loss backward", "backward other", "optimizer")
# module-name suffixes of each phase: HF Llama (model.layers.N.self_attn ...) and Megatron-Core's GPTModel
# (decoder.layers.N.self_attention ...); the critic's value head is `head` (plain) / `value_head` (engine)
_SUFFIXES = {
    "embedding": ("embed_tokens", "embedding"),
    "norms": ("input_layernorm", "post_attention_layernorm", "pre_mlp_layernorm", "final_layernorm", "model.norm",
              "backbone.norm"),
    "attention": ("self_attn", "self_attention"),
    "mlp": ("mlp",),
    "head": ("lm_head", "output_layer", "value_head", "head"),
}


def _phase_of(name: str) -> str | None:
    last = name.rsplit(".", 1)[-1]
    for phase, suffixes in _SUFFIXES.items():
        if any(name.endswith(s) if "." in s else last == s for s in suffixes):
            return phase
    return None


def _first_grad_tensor(x):
    if torch.is_tensor(x):
        return x if x.requires_grad else None
    if isinstance(x, (tuple, list)):
        for item in x:
            t = _first_grad_tensor(item)
            if t is not None:
                return t
    return None


class PhaseTimer:
    """Seconds per phase, summed over the steps run while its hooks are on `model` (until `remove()`); the
    caller reports where each micro-batch's loss is computed and where its backward returns."""

    def __init__(self, model: torch.nn.Module, clock) -> None:
        self.clock = clock
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._fwd_start: dict[int, float] = {}
        self._bwd_start: dict[int, float] = {}
        self._head_done: float | None = None
        self._backward_start: float | None = None
        self._first_head_bwd: float | None = None
        self._bwd_measured = 0.0
        self.handles = []
        for name, module in model.named_modules():
            phase = _phase_of(name)
            if phase is not None:
                self.handles.append(module.register_forward_pre_hook(self._pre))
                self.handles.append(module.register_forward_hook(self._post(phase), with_kwargs=True))

    def _pre(self, module, args) -> None:
        self._fwd_start[id(module)] = self.clock()

    def _post(self, phase: str):
        def hook(module, args, kwargs, output):
            now = self.clock()
            self.seconds[phase] += now - self._fwd_start.pop(id(module))
            if phase == "head":
                self._head_done = now
            out = _first_grad_tensor(output)
            inp = _first_grad_tensor((args, tuple(kwargs.values())))
            if out is None or inp is None:  # the embedding (token ids in): its backward counts as "backward other"
                return
            key = object()
            out.register_hook(self._bwd_begin(key, phase))
            inp.register_hook(self._bwd_end(key, phase))
        return hook

    def _bwd_begin(self, key, phase: str):
        def hook(grad):
            now = self.clock()
            if phase == "head" and self._first_head_bwd is None:
                self._first_head_bwd = now
            self._bwd_start[key] = now
        return hook

    def _bwd_end(self, key, phase: str):
        def hook(grad):
            start = self._bwd_start.pop(key, None)
            if start is not None:
                dt = self.clock() - start
                self.seconds[phase] += dt
                self._bwd_measured += dt
        return hook

    def loss_done(self) -> None:
        """Called when the loss of a micro-batch is computed (the backward starts next)."""
        now = self.clock()
        if self._head_done is not None:
            self.seconds["loss"] += now - self._head_done
            self._head_done = None
        self._backward_start = now

    def backward_done(self) -> None:
        """Called when a micro-batch's backward has returned."""
        now = self.clock()
        if self._backward_start is not None and self._first_head_bwd is not None:
            self.seconds["loss backward"] += self._first_head_bwd - self._backward_start
            self.seconds["backward other"] += (now - self._first_head_bwd) - self._bwd_measured
        self._backward_start = self._first_head_bwd = None
        self._bwd_measured = 0.0

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
