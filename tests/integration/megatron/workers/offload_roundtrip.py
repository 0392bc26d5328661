"""Trainer offload on the real Megatron buffers (world size 1).
Usage: python -m tests.integration.megatron.workers.offload_roundtrip <tmp_dir>

Prints RESULT lines parsed by tests/integration/megatron/test_offload.py. For fp32 and bf16 actors and a
critic with frozen parameters: offload + onload restores params, optimizer main params and Adam state
bit-exactly, the device storages are really released in between, and a step after the round trip equals
the step of a twin engine that never offloaded.
"""

from __future__ import annotations

import os
import sys

import torch

# engine_common first: it applies the CPU patches before any Megatron module is imported.
from tests.integration.megatron.workers.engine_common import emit, make_batch, mse_loss, nll_loss, tiny_model_dir

# isort: split
from megatron_sao.megatron.engine import InitSource, MegatronEngine
from megatron_sao.megatron.optimizer import OptimConfig
from megatron_sao.megatron.parallel import init_parallel
from megatron_sao.models.freeze import CRITIC_FROZEN_ATTENTION
from megatron_sao.models.parallel_sizes import ParallelSizes

tmp = sys.argv[1]
hf_dir = os.path.join(tmp, "hf")
spec, _ = tiny_model_dir(hf_dir)
sizes = ParallelSizes()
ctx = init_parallel(sizes)
batch = make_batch(spec.vocab_size)
batch2 = make_batch(spec.vocab_size, seed=11)
OPT = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5)


def engine(role="actor", **kw):
    return MegatronEngine(spec, sizes, OPT, role=role, init=InitSource.from_hf(hf_dir), micro_batch_size=2,
                          ctx=ctx, **kw)


def state(e) -> dict[str, torch.Tensor]:
    """Every tensor the offload moves, by a stable name: params, optimizer main params, Adam state."""
    out = {f"param/{n}": p.detach().clone() for n, p in e.module.named_parameters()}
    for i, inner in enumerate(e._offload._inner_optimizers()):
        for g, group in enumerate(inner.param_groups):
            for j, p in enumerate(group["params"]):
                out[f"main/{i}/{g}/{j}"] = p.detach().clone()
                for k, v in inner.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        out[f"state/{i}/{g}/{j}/{k}"] = v.detach().clone()
    return out


def same(a: dict, b: dict) -> list[str]:
    """Names whose bytes differ (bit-exact: torch.equal, NaN-free here)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return [k for k in a if not torch.equal(a[k], b[k])]


def round_trip(tag: str, role="actor", loss=nll_loss, **kw) -> None:
    a, b = engine(role, **kw), engine(role, **kw)  # twins: b never offloads
    a.train_step(batch, loss)  # creates the Adam state
    b.train_step(batch, loss)
    before = state(a)
    resident = a.device_bytes()
    off = a.offload()
    released = a.device_bytes()
    try:
        a.logprobs(batch) if role == "actor" else a.values(batch)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    on = a.onload()
    differs = same(before, state(a))
    ra, rb = a.train_step(batch2, loss), b.train_step(batch2, loss)
    emit(tag, {"resident": resident, "released": released, "offloaded_bytes": off.bytes, "onloaded_bytes": on.bytes,
               "refused_while_offloaded": refused, "differs_after_round_trip": differs[:5],
               "step_after_differs": same(state(a), state(b))[:5], "loss": [ra.loss, rb.loss],
               "grad_norm": [ra.grad_norm, rb.grad_norm],
               "frozen_params": sum(not p.requires_grad for p in a.module.parameters())})


round_trip("fp32_actor")
round_trip("bf16_actor", params_dtype=torch.bfloat16)
round_trip("frozen_critic", role="critic", loss=mse_loss, freeze_patterns=CRITIC_FROZEN_ATTENTION)

# Partial offload (the colocated update phase): grads + optimizer away, params stay and still export.
e = engine()
e.train_step(batch, nll_loss)
lp = e.logprobs(batch)
e.offload(("grads", "optimizer"))
partial = e.device_bytes()
lp_partial = e.logprobs(batch)
n_every = sum(len(b) for b in e.export_hf_weights_every_rank(bucket_bytes=32 << 10))
n_root = sum(len(b) for b in e.export_hf_weights(bucket_bytes=32 << 10))
e.onload()
emit("partial", {"device_bytes": partial, "logprobs_equal": bool(torch.equal(lp, lp_partial)),
                 "exported_every_rank": n_every, "exported_root": n_root})
print("OFFLOAD DONE", flush=True)
