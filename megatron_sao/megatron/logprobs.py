"""Per-token log-probs from vocab-parallel logits, in sequence chunks, never holding fp32 logits whole.

The LM head's output is [b, s, V/TP] in the training dtype; at 128K tokens and TP 4 that is 9.3 GiB in
bf16. The obvious route (an fp32 copy, the padded vocabulary masked with ``masked_fill``, then
megatron-core's ``vocab_parallel_cross_entropy``, which keeps its fp32 exp-logits for the backward
pass) holds three more tensors of that size in fp32: 46 GiB for that micro-batch. Here the log-softmax
is taken a chunk of rows at a time, in two passes over the logits:
1. the row maxima over this rank's real vocabulary columns (the padded rows of the vocabulary,
   models/vocab.py, are left out, not masked), all-reduced (MAX) over the TP group;
2. per chunk, y = logit - max in fp32 (the cast is the subtraction's, no copy of the chunk first) and
   e = exp(y), reduced into the sum of e and, for the entropy, the sum of e * y; with the target's logit
   these are all-reduced (SUM) once for the whole micro-batch.
So a micro-batch costs two all-reduces whatever its chunk count, and beyond the logits themselves the
stage holds two fp32 chunk buffers ([chunk, V/TP], reused by every chunk) and [b, s] vectors. The
backward pass recomputes each chunk's softmax from the saved logits and writes the gradient into the
logits' own storage, as megatron-core's cross entropy writes it into its fp32 copy. Liger-Kernel's and
verl's chunked log-prob losses rest on the same identity, grad_logits = g * (softmax - onehot(target))
with g = -dL/dlogp.

The policy's entropy over the vocabulary comes out of the same chunk loop when asked for: with
S = sum e over every TP rank, H = log S - sum(e * y) / S. The product e * y is taken in place on the
chunk's exp; it is why the forward keeps y beside e (a second buffer) instead of e * log e, whose log
costs more than the rest of the pass on a CPU. The entropy is a metric unless a loss uses it (the
entropy bonus, `algorithm.entropy_coef`): then its gradient, dH/dlogit = -p * (log p + H), joins the
log-prob's in the same backward chunk loop (one more fp32 chunk buffer for p beside log p). An output
the loss does not use receives no gradient and costs the backward nothing.

The chunk: on CUDA, `DEFAULT_CHUNK_TOKENS` rows (few launches; the caching allocator recycles the
buffers). On a CPU each chunk is a few passes of memory-bound elementwise work, fast only while the
chunk stays in the cache and its buffers are recycled heap, not fresh pages: `CPU_CHUNK_BYTES` of
fp32 per buffer (SmolLM2's 49K vocabulary: 21 rows; on 1120 x 49152 fp32 logits, one thread, the
pass's forward and backward took 0.12 CPU s at 21 rows and 0.19 s at 341).

The logits passed in must not be read after the backward pass (their storage holds the gradient
then); the engine's forward has no other reader.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# 512 x 151936/TP fp32 = 0.29 GiB per buffer at TP 1, two buffers; a 128K-token micro-batch is 256
# chunks of a few kernels each, and still two all-reduces
DEFAULT_CHUNK_TOKENS = 512
# y and exp(y) in the forward; in the backward the fp32 chunk (bf16 logits) and, with an entropy loss, p
FP32_CHUNK_BUFFERS = 2
CPU_CHUNK_BYTES = 4 << 20


def chunk_tokens_for(device: torch.device, columns: int) -> int:
    """Rows of one chunk of a [N, columns] logits shard on `device` (module docstring)."""
    if device.type == "cpu":
        return max(1, CPU_CHUNK_BYTES // (4 * max(1, columns)))
    return DEFAULT_CHUNK_TOKENS


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
    entropy [N] fp32 or an empty tensor when `with_entropy` is False); both differentiable."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_start: int, valid: int, chunk: int, group, with_entropy: bool):
        n, vl = logits.shape
        f32 = dict(dtype=torch.float32, device=logits.device)
        real = logits[:, :valid]  # the forward never writes the caller's logits
        local = labels - vocab_start
        own = (local >= 0) & (local < valid)  # the target's logit lives on this TP rank
        local = local.clamp(0, vl - 1)
        lse = torch.full((n,), float("-inf"), **f32)  # the row max first; the log-sum-exp in the end
        if valid:  # a TP rank whose shard is all padding keeps -inf: the other ranks' maxima win
            for i in range(0, n, chunk):
                lse[i:i + chunk] = real[i:i + chunk].amax(dim=1)
        _all_reduce(lse, dist.ReduceOp.MAX, group)
        # rows: sum of e, the target's logit (and sum of e * y): one all-reduce for the micro-batch
        sums = torch.zeros(3 if with_entropy else 2, n, **f32)
        sums[1] = torch.where(own, logits.gather(1, local[:, None]).squeeze(1).float(), 0.0)
        y_buf = torch.empty(min(chunk, n), valid, **f32)
        e_buf = torch.empty_like(y_buf) if with_entropy else None
        for i in range(0, n if valid else 0, chunk):
            rows = min(chunk, n - i)
            y = torch.sub(real[i:i + rows], lse[i:i + rows, None], out=y_buf[:rows])
            if with_entropy:
                e = torch.exp(y, out=e_buf[:rows])
                torch.sum(e, dim=1, out=sums[0, i:i + rows])
                torch.sum(e.mul_(y), dim=1, out=sums[2, i:i + rows])
            else:
                torch.sum(y.exp_(), dim=1, out=sums[0, i:i + rows])
        del y_buf, e_buf
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        log_sum_exp = sums[0].log()
        entropy = (log_sum_exp - sums[2] / sums[0]) if with_entropy else torch.empty(0, **f32)
        lse.add_(log_sum_exp)
        logp = sums[1] - lse
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None: no work for it
        ctx.save_for_backward(logits, lse, local, own, entropy)
        ctx.valid, ctx.chunk = valid, chunk
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, lse, local, own, entropy = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return (None,) * 7
        n, vl = logits.shape
        g = None if grad_logp is None else grad_logp.float()
        g_ent = None if grad_entropy is None else grad_entropy.float()
        f32 = dict(dtype=torch.float32, device=logits.device)
        rows_max = min(ctx.chunk, n)
        # fp32 logits are turned into their gradient in place; other dtypes go through one fp32 buffer
        buf = None if logits.dtype == torch.float32 else torch.empty(rows_max, vl, **f32)
        p_buf = None if g_ent is None else torch.empty(rows_max, vl, **f32)
        for i in range(0, n, ctx.chunk):
            rows = min(ctx.chunk, n - i)
            at = slice(i, i + rows)
            out = logits[at] if buf is None else buf[:rows].copy_(logits[at])
            out.sub_(lse[at, None])  # log p of the chunk
            if g_ent is None:
                p = out.exp_()  # the chunk's softmax, in place
            else:  # dH/dlogit = -p * (log p + H), into log p's storage; p beside it
                p = torch.exp(out, out=p_buf[:rows])
                out.add_(entropy[at, None]).mul_(p).mul_(-g_ent[at, None])
            if g is not None:  # d logp / d logits = onehot - softmax
                target = (torch.arange(rows, device=out.device), local[at])
                if g_ent is None:
                    p[target] -= own[at].float()
                    p.mul_(-g[at, None])
                else:
                    out.addcmul_(p, g[at, None], value=-1.0)
                    out[target] += own[at].float() * g[at]
            if ctx.valid < vl:
                out[:, ctx.valid:] = 0.0
            if buf is not None:
                logits[at] = out  # the logits are not read again (module docstring)
        return logits, None, None, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None,
                            chunk_tokens: int | None = None, *, with_entropy: bool = False):
    """log softmax(logits)[label] for every position: logits [..., V/TP] (this TP rank's shard of a
    vocabulary padded to V/TP * TP columns), labels [...] global ids -> fp32 [...].

    `vocab_size` (the real vocabulary) keeps the padding columns out of the normaliser; None: every
    column is a token. `chunk_tokens`: rows of one chunk (None: `chunk_tokens_for` the logits' device).
    `with_entropy`: return (log-probs, entropy of each position's distribution over the real
    vocabulary, fp32 [...]); a loss may differentiate either."""
    group, rank = _tp_group()
    vl = logits.shape[-1]
    start = rank * vl
    valid = vl if vocab_size is None else max(0, min(vl, vocab_size - start))
    flat = logits.reshape(-1, vl)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    chunk = chunk_tokens_for(flat.device, vl) if chunk_tokens is None else max(1, chunk_tokens)
    logp, entropy = _ChunkedLogprob.apply(flat, labels.reshape(-1), start, valid, chunk, group, with_entropy)
    if with_entropy:
        return logp.view(labels.shape), entropy.view(labels.shape)
    return logp.view(labels.shape)
