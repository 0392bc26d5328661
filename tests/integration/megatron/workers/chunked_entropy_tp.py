"""The chunked log-prob + entropy pass at TP 2 (torchrun, gloo): each rank holds half the vocabulary
of the same logits (with padding columns on the last rank) and must return the full-softmax values
and, for a loss on both outputs, the full-softmax gradient (the shards' gradients gathered).
Usage: torchrun --nproc_per_node 2 -m tests.integration.megatron.workers.chunked_entropy_tp
Prints `RESULT <tag> <json>` on rank 0."""

from __future__ import annotations

import torch
import torch.distributed as dist

# engine_common first: it applies the CPU patches before any Megatron module is imported.
from tests.integration.megatron.workers.engine_common import emit

# isort: split
from megatron_sao.megatron.logprobs import vocab_parallel_logprobs
from megatron_sao.megatron.parallel import init_parallel
from megatron_sao.models.parallel_sizes import ParallelSizes

ctx = init_parallel(ParallelSizes(tp=2))
torch.manual_seed(0)
b, s, v_padded = 3, 29, 64
# vocab 50: 14 padding columns, all on rank 1; vocab 20: rank 1's shard is all padding (no real column)
for vocab in (50, 20):
    for dtype in (torch.float32, torch.bfloat16):
        full = (torch.randn(b, s, v_padded) * 3).to(dtype)
        labels = torch.randint(0, vocab, (b, s))
        half = v_padded // 2
        shard = full[..., ctx.tp_rank * half:(ctx.tp_rank + 1) * half].clone()
        w_lp, w_ent = torch.randn(b, s), torch.randn(b, s)
        for chunk in (1, 8, 1000):
            logits = shard.clone().requires_grad_(True)
            lp, ent = vocab_parallel_logprobs(logits, labels, vocab, chunk_tokens=chunk, with_entropy=True)
            ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
            grads = [torch.empty_like(logits.grad) for _ in range(2)]
            dist.all_gather(grads, logits.grad.contiguous())
            if ctx.rank == 0:
                emit(f"{vocab}_{dtype}_{chunk}", {"logprobs": lp.tolist(), "entropy": ent.tolist(), "vocab": vocab,
                                                  "full": full.float().tolist(), "labels": labels.tolist(),
                                                  "grad": torch.cat(grads, dim=-1).float().tolist(),
                                                  "w_lp": w_lp.tolist(), "w_ent": w_ent.tolist()})
