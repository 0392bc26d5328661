"""Per-token log-probs from vocab-parallel logits, in sequence chunks, never holding fp32 logits whole.

The LM head's output is [b, s, V/TP] in the training dtype; at 128K tokens and TP 4 that is 9.3 GiB in
bf16. The obvious route (an fp32 copy, the padded vocabulary masked with ``masked_fill``, then
megatron-core's ``vocab_parallel_cross_entropy``, which keeps its fp32 exp-logits for the backward
pass) holds three more tensors of that size in fp32: 46 GiB for that micro-batch. Here the log-softmax
is taken ``chunk_tokens`` rows at a time: each chunk is cast to fp32, its padding columns set to -inf
in place, and reduced over the TP group (max, sum of exp, the target's logit) into two fp32 numbers
per token; the backward pass recomputes each chunk's softmax from the saved logits and writes the
gradient into the logits' own storage, as megatron-core's cross entropy writes it into its fp32 copy.
So beyond the logits themselves the stage holds one fp32 chunk ([chunk_tokens, V/TP]) and [b, s]
vectors. Liger-Kernel's and verl's chunked log-prob losses rest on the same identity,
grad_logits = g * (softmax - onehot(target)) with g = -dL/dlogp.

The policy's entropy over the vocabulary, a metric (no gradient flows through it), comes out of the
same chunk loop when asked for: with e = exp(logit - max) and S = sum e over every TP rank,
H = log S - sum(e * log e) / S, where e * log e is taken in place on the chunk's exp (``xlogy``, 0 for
the -inf padding), so it costs one more pass over the chunk and no memory.

The logits passed in must not be read after the backward pass (their storage holds the gradient
then); the engine's forward has no other reader.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# 1024 x 151936/TP fp32 = 0.58 GiB at TP 1; two small all-reduces a chunk (256 for a 128K-token
# micro-batch, of 1024 and 2-3 x 1024 floats: microseconds beside the forward of 128K tokens)
DEFAULT_CHUNK_TOKENS = 1024


def _tp_group():
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None, 0
    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()


def _all_reduce(t: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


class _ChunkedLogprob(torch.autograd.Function):
    """logits [N, Vl] (this TP rank's vocab shard), labels [N] (global ids) -> (log p(label) [N] fp32,
    entropy [N] fp32 or an empty tensor when `with_entropy` is False; never differentiated)."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_start: int, valid: int, chunk: int, group, with_entropy: bool):
        n, vl = logits.shape
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)  # log-sum-exp over the whole vocab
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=logits.device)
        local = labels - vocab_start
        own = (local >= 0) & (local < valid)  # the target's logit lives on this TP rank
        local = local.clamp(0, vl - 1)
        for i in range(0, n, chunk):
            x = logits[i:i + chunk].to(torch.float32, copy=True)  # the forward never writes the caller's logits
            if valid < vl:
                x[:, valid:] = float("-inf")  # the padded vocabulary rows are not tokens (models/vocab.py)
            # rows: sum of exp, the target's logit (and sum of e log e): one all-reduce for all of them
            sums = torch.empty(3 if with_entropy else 2, x.shape[0], dtype=torch.float32, device=x.device)
            sums[1] = torch.where(own[i:i + chunk], x.gather(1, local[i:i + chunk, None]).squeeze(1), 0.0)
            m = x.max(dim=1).values
            _all_reduce(m, dist.ReduceOp.MAX, group)
            x.sub_(m[:, None]).exp_()
            sums[0] = x.sum(dim=1)
            if with_entropy:
                sums[2] = x.xlogy_(x).sum(dim=1)  # e log e, with log e = logit - max exactly where e > 0
            _all_reduce(sums, dist.ReduceOp.SUM, group)
            log_sum_exp = sums[0].log()
            lse[i:i + chunk] = m + log_sum_exp
            logp[i:i + chunk] = sums[1] - lse[i:i + chunk]
            if with_entropy:
                entropy[i:i + chunk] = log_sum_exp - sums[2] / sums[0]
            del x
        ctx.save_for_backward(logits, lse, local, own)
        ctx.valid, ctx.chunk = valid, chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):  # grad_entropy: none flows (a metric)
        logits, lse, local, own = ctx.saved_tensors
        n, vl = logits.shape
        g = grad_logp.float()
        for i in range(0, n, ctx.chunk):
            # softmax of the chunk; fp32 logits are turned into it in place (their storage takes the gradient)
            p = logits[i:i + ctx.chunk].float().sub_(lse[i:i + ctx.chunk, None]).exp_()
            if ctx.valid < vl:
                p[:, ctx.valid:] = 0.0
            rows = torch.arange(p.shape[0], device=p.device)
            p[rows, local[i:i + ctx.chunk]] -= own[i:i + ctx.chunk].float()
            p.mul_(-g[i:i + ctx.chunk, None])  # d logp / d logits = onehot - softmax
            if p.dtype != logits.dtype:  # fp32 logits: p is already their slice, written in place
                logits[i:i + ctx.chunk] = p  # the logits are not read again (module docstring)
            del p
        return logits, None, None, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None,
                            chunk_tokens: int = DEFAULT_CHUNK_TOKENS, *, with_entropy: bool = False):
    """log softmax(logits)[label] for every position: logits [..., V/TP] (this TP rank's shard of a
    vocabulary padded to V/TP * TP columns), labels [...] global ids -> fp32 [...].

    `vocab_size` (the real vocabulary) keeps the padding columns out of the normaliser; None: every
    column is a token. `with_entropy`: return (log-probs, entropy of each position's distribution
    over the real vocabulary, fp32 [...], no gradient)."""
    group, rank = _tp_group()
    vl = logits.shape[-1]
    start = rank * vl
    valid = vl if vocab_size is None else max(0, min(vl, vocab_size - start))
    flat = logits.reshape(-1, vl)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    logp, entropy = _ChunkedLogprob.apply(flat, labels.reshape(-1), start, valid, max(1, chunk_tokens), group,
                                          with_entropy)
    if with_entropy:
        return logp.view(labels.shape), entropy.view(labels.shape)
    return logp.view(labels.shape)
