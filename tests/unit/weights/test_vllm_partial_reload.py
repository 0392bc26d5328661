"""What an aborted refit leaves in vLLM's workers (the docs say it; this pins vLLM's behaviour).

``sao_abort_weight_update`` ends a failed update through vLLM's ``finalize_layerwise_reload``. A layer
that received nothing gets its previous tensors back; a layer that received all of them holds the new
ones; a layer cut by the failed bucket is materialized with ``torch.empty_strided`` and loaded with what
arrived, so the tensors it did not receive hold whatever that memory held. Here the fresh memory is
filled with NaN (by wrapping vLLM's materialize) to make "uninitialised" visible: the partially
received layer's missing tensor comes out NaN, not its previous values."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

pytest.importorskip("vllm")


class _Experts(nn.Module):
    """A layer of two weights, like a fused-MoE layer's ``w13_weight`` and ``w2_weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.randn(8, 16))
        self.w2 = nn.Parameter(torch.randn(16, 8))


def test_a_partially_received_layer_holds_uninitialised_memory(monkeypatch):
    from vllm.model_executor.model_loader.reload import layerwise, meta

    real = meta.materialize_meta_tensor

    def poisoned(tensor):
        return real(tensor).fill_(float("nan"))

    monkeypatch.setattr(meta, "materialize_meta_tensor", poisoned)
    torch.manual_seed(0)
    model = nn.Sequential(_Experts(), _Experts(), _Experts())
    old = {k: v.detach().clone() for k, v in model.state_dict().items()}
    new = {k: torch.randn_like(v) for k, v in old.items()}
    layerwise.record_metadata_for_reloading(model)
    layerwise.initialize_layerwise_reload(model)
    for name in ("0.w13", "0.w2", "1.w13"):  # layer 0 whole, layer 1 cut after its first weight, layer 2 nothing
        layer, attr = model[int(name[0])], name.split(".")[1]
        param = getattr(layer, attr)
        param.weight_loader(param, new[name])
    layerwise.finalize_layerwise_reload(model, types.SimpleNamespace(dtype=torch.float32))  # what the abort runs
    got = model.state_dict()
    assert torch.equal(got["0.w13"], new["0.w13"]) and torch.equal(got["0.w2"], new["0.w2"])
    assert torch.equal(got["1.w13"], new["1.w13"])
    assert torch.isnan(got["1.w2"]).all()  # never received: the fresh memory's content, not its old values
    assert torch.equal(got["2.w13"], old["2.w13"]) and torch.equal(got["2.w2"], old["2.w2"])
