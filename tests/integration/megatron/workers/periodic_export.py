"""The actor's periodic HF export (trainer/hf_export.py::export_step) and the train step's entropy
metric, on a real engine (world size 1). Usage: python -m tests.integration.megatron.workers.periodic_export <tmp_dir>

Prints RESULT lines parsed by tests/integration/megatron/test_periodic_export.py: after each of three train steps
an export that transformers' AutoModelForCausalLM loads, with log-probs equal to the engine's; which
exports remain; an export that fails mid-stream leaving nothing; the step's `entropy` against the HF
model's full softmax.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

# engine_common first: it applies the CPU patches before any Megatron module is imported.
from tests.integration.megatron.workers.engine_common import emit, hf_logprobs, make_batch, nll_loss, tiny_model_dir

# isort: split
from megatron_sao.megatron.engine import InitSource, MegatronEngine
from megatron_sao.megatron.optimizer import OptimConfig
from megatron_sao.megatron.parallel import init_parallel
from megatron_sao.models.parallel_sizes import ParallelSizes
from megatron_sao.trainer.hf_export import export_step

tmp = Path(sys.argv[1])
hf_dir = str(tmp / "hf")
spec, hf0 = tiny_model_dir(hf_dir)
sizes = ParallelSizes()
ctx = init_parallel(sizes)
engine = MegatronEngine(spec, sizes, OptimConfig(lr=1e-2), role="actor", init=InitSource.from_hf(hf_dir),
                        micro_batch_size=2, ctx=ctx)
batch = make_batch(spec.vocab_size)
root = tmp / "exports"


def hf_entropy(hf, batch) -> float:
    """Token mean over the action tokens of the entropy of the distribution each was drawn from."""
    with torch.no_grad():
        logits = hf(input_ids=batch["tokens"]).logits.float()
    ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)[:, :-1]  # predicts token t + 1
    mask = batch["action_mask"][:, 1:]
    return float(ent[mask].mean())


for step in (1, 2, 3):
    want_entropy = hf_entropy(AutoModelForCausalLM.from_pretrained(hf_dir if step == 1 else str(
        root / f"step_{step - 1:06d}"), dtype=torch.float32), batch)
    result = engine.train_step(batch, nll_loss)
    out = export_step(engine, hf_dir, root, step)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    diff = (hf_logprobs(hf, batch) - engine.logprobs(batch)).abs().max().item()
    moved = (hf_logprobs(hf, batch) - hf_logprobs(hf0, batch)).abs().max().item()
    emit(f"step{step}", {"max_abs_diff": diff, "moved_from_base": moved, "entropy": result.metrics["entropy"],
                         "hf_entropy": want_entropy,
                         "kept": sorted(p.name for p in root.iterdir())})


class FailingMidStream:
    """The engine's export, but the gather fails after the first bucket (a rank dying mid-export)."""
    ctx = engine.ctx

    def export_hf_weights(self, bucket_bytes):
        buckets = engine.export_hf_weights(1 << 10)
        yield next(buckets)
        raise RuntimeError("rank lost mid-export")


try:
    export_step(FailingMidStream(), hf_dir, root, 4)
    failed = None
except RuntimeError as e:
    failed = str(e)
emit("failed", {"error": failed, "left": sorted(p.name for p in root.iterdir())})
print("EXPORT DONE", flush=True)
