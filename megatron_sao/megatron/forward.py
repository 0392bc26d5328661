"""Forward passes through Megatron's pipeline schedules: per-token log-probs, values, and losses.

All model calls go through `get_forward_backward_func()`, so the same code runs with and without
pipeline parallelism. The schedule calls `forward_step(data_iterator, model)` once per
micro-batch; on the last pipeline stage it then calls the returned `loss_func(output_tensor)`.

Loss scaling (how a global token-mean comes out exactly): the model config has
`calculate_per_token_loss=True` and every loss_func returns a 3-tuple (loss, 1, metrics). With
that flag Megatron (a) does not divide the loss by the number of micro-batches, and (b) builds the
DDP grad buffers with gradient_scaling_factor = 1, i.e. gradients are SUMMED over DP ranks. The
engine's finalize hook passes num_tokens=None, so nothing divides afterwards either. The user loss
divides each micro-batch's token sum by the GLOBAL action-token count (`loss_denominator`), so
the sum over micro-batches and DP ranks of those losses - and of their gradients - is exactly
the token-mean over the whole batch.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_sao.megatron.batching import Batch
from megatron_sao.megatron.logprobs import vocab_parallel_logprobs

LossFn = Callable[[torch.Tensor, Batch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
_ONE = torch.ones((), dtype=torch.int)
_WEIGHT = "__action_tokens__"  # per-micro-batch weight for mean-type metrics


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int | None = None, *,
                   with_entropy: bool = False, seq_first: bool = False):
    """log p(tokens[:, t] | tokens[:, :t]) placed at position t ([b, s]); position 0 gets 0.

    `logits` is [b, s, V/TP]: the vocab stays sharded (max and sum-exp are reduced over the TP group,
    so no rank ever holds the full vocabulary) and the log-softmax is taken in sequence chunks, so no
    fp32 copy of the logits is ever whole (megatron/logprobs.py). `vocab_size` (the real one) keeps
    the padding rows of the vocabulary (models/vocab.py) out of the normaliser. The logits' storage
    holds their gradient after the backward pass. `with_entropy`: also the entropy of the distribution
    token t was drawn from, at position t (a metric: no gradient), as a second [b, s] tensor.
    `seq_first`: the logits are [s, b, V/TP], the output layer's layout (models/gpt.py::ActorGPTModel):
    read where they are, no transposed copy; the outputs are [b, s] all the same.
    """
    labels = torch.roll(tokens, shifts=-1, dims=1)  # labels[:, t] = tokens[:, t + 1]
    # The last column has no next token: its (wrapped) label is computed and thrown away.
    out = vocab_parallel_logprobs(logits, labels.t() if seq_first else labels, vocab_size, with_entropy=with_entropy)
    out = out if with_entropy else (out,)
    if seq_first:
        out = tuple(x.t() for x in out)  # [s, b] -> [b, s]: small vectors
    shifted = [torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1) for x in out]
    return tuple(shifted) if with_entropy else shifted[0]


def model_inputs(mb: Batch) -> tuple[torch.Tensor, torch.Tensor, None]:
    """(tokens, positions, attention_mask) for GPTModel.

    The mask is None: every layer spec declares AttnMaskType.causal, so TE's flash/fused kernels
    apply causality without a mask tensor, and the local spec's unfused softmax builds its own
    causal mask per call (Megatron's get_default_causal_mask; on a CPU the cpu_compat
    TorchFunctionMode moves it off "cuda"). No S x S mask is ever built or cached here (at 128K
    tokens one would be 16 GiB).
    """
    tokens = mb["tokens"]
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    return tokens, positions.contiguous(), None


def head_output(role: str, output: torch.Tensor, tokens: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """Actor: logits [s, b, V/TP] (`model_kwargs`) -> per-token log-probs [b, s]. Critic: values [b, s, 1] -> [b, s]."""
    if role == "actor":
        return token_logprobs(output, tokens, vocab_size, seq_first=True)
    if output.dim() != 3 or output.shape[-1] != 1 or output.shape[:2] != tokens.shape:
        raise RuntimeError(f"critic model returned shape {tuple(output.shape)}, expected [b, s, 1] "
                           f"with [b, s] = {list(tokens.shape)}")
    return output.squeeze(-1).float()


def model_kwargs(role: str, tokens: torch.Tensor) -> dict:
    """The actor is called with labels: ActorGPTModel then returns its logits as the output layer made
    them, [s, b, V/TP], instead of a transposed contiguous copy (models/gpt.py)."""
    return {"labels": tokens} if role == "actor" else {}


def run_schedule(
    model_chunks: list,
    micro_batches: list[Batch],
    seq_length: int,
    make_loss_func: Callable[[Batch], Callable],
    *,
    forward_only: bool,
    role: str,
    routing=None,
) -> list:
    """One pass of Megatron's forward(-backward) schedule over `micro_batches`.

    Micro-batches may be narrower than `seq_length` (each is as wide as its own longest row, see
    megatron/batching.py). Returns the per-micro-batch metric dicts (non-empty on the last pipeline stage only).
    `routing` (megatron/routing_replay.py, MoE actor): each micro-batch's `routes` become its routers'
    replay targets before its forward, and recompute in its backward replays the same ones.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator: Iterator[Batch], model):
        mb = next(data_iterator)
        tokens, positions, mask = model_inputs(mb)
        if routing:
            routing.before_forward(mb)
        output = model(tokens, positions, mask, **model_kwargs(role, tokens))
        if routing:
            routing.after_forward()
        return output, make_loss_func(mb)

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=model_chunks,
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=micro_batches[0]["tokens"].shape[0],
        forward_only=forward_only,
    )


def forward_outputs(
    role: str, model_chunks: list, micro_batches: list[Batch], seq_length: int, *, vocab_size: int | None,
    routing=None,
) -> list[torch.Tensor]:
    """Per-micro-batch [b, seq_length] outputs (log-probs or values), forward only; [] off the last stage."""

    def make_loss_func(mb: Batch):
        def loss_func(output: torch.Tensor):
            out = head_output(role, output, mb["tokens"], vocab_size).detach()
            if out.shape[1] < seq_length:  # trimmed micro-batch: zero-fill the dropped padding columns
                out = torch.nn.functional.pad(out, (0, seq_length - out.shape[1]))
            return torch.zeros((), dtype=torch.float32), _ONE, {"out": out}

        return loss_func

    with torch.no_grad():
        store = run_schedule(model_chunks, micro_batches, seq_length, make_loss_func, forward_only=True, role=role,
                             routing=routing)
    return [d["out"] for d in store]


def make_train_loss_func(role: str, loss_fn: LossFn, denominator: torch.Tensor, *, vocab_size: int | None):
    """Wrap a user loss `loss_fn(output [b,s], micro_batch, denominator) -> (loss, metrics)`. The actor's
    micro-batch also carries `entropy` [b, s]: the entropy of the distribution each token was drawn from
    (differentiable; the engine reports its token mean over the action tokens as `entropy`)."""

    def make_loss_func(mb: Batch):
        def loss_func(output: torch.Tensor):
            entropy = None
            if role == "actor":  # the policy's entropy comes out of the same chunked pass: the loss
                # may use it (an entropy bonus; its gradient costs the backward nothing otherwise)
                out, entropy = token_logprobs(output, mb["tokens"], vocab_size, with_entropy=True, seq_first=True)
                result = loss_fn(out, {**mb, "entropy": entropy}, denominator)
            else:
                result = loss_fn(head_output(role, output, mb["tokens"], vocab_size), mb, denominator)
            if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
                raise TypeError("loss_fn must return (loss: 0-dim tensor, metrics: dict[str, 0-dim tensor])")
            loss, metrics = result
            if not torch.is_tensor(loss) or loss.dim() != 0:
                raise TypeError(f"loss_fn returned a loss of shape {getattr(loss, 'shape', type(loss))}; "
                                f"need a 0-dim tensor")
            reported = {"loss": loss.detach().float(), _WEIGHT: mb["action_mask"].float().sum()}
            if entropy is not None:  # token mean over the action tokens (weighted across micro-batches)
                action = mb["action_mask"].bool()
                reported["entropy"] = torch.where(action, entropy.detach(), 0.0).sum() / action.sum().clamp(min=1)
            for k, v in metrics.items():
                # a Python number becomes a tensor beside the output: DP ranks all-reduce these
                reported[k] = (v.detach() if torch.is_tensor(v)
                               else torch.tensor(v, device=loss.device)).float().reshape(())
            return loss, _ONE, reported

        return loss_func

    return make_loss_func


def _reduction(key: str) -> str:
    if key.endswith("_max"):
        return "max"
    if key.endswith("_min"):
        return "min"
    if key == "loss" or key.endswith("_count") or key.endswith("_sum"):
        return "sum"
    return "mean"


def reduce_step_metrics(store: list[dict[str, torch.Tensor]], ctx) -> dict[str, float]:
    """Combine per-micro-batch metrics over micro-batches and DP ranks; every rank gets the dict.

    Rules by key: `loss`, `*_count`, `*_sum` are summed (the loss is already divided by the global
    denominator, so its sum is the global token-mean); `*_max` / `*_min` take max / min; any other
    key is a per-micro-batch mean over action tokens and is averaged with weights = that
    micro-batch's action-token count (exact for means and fractions over action tokens).
    """
    payload: list = [None]
    if ctx.is_last_stage:
        keys = sorted(k for k in store[0] if k != _WEIGHT) if store else []
        weights = torch.stack([d[_WEIGHT] for d in store]).double() if store else torch.zeros(0)
        out = {}
        for k in keys:
            vals = torch.stack([d[k] for d in store]).double()
            rule = _reduction(k)
            if rule == "max":
                v, op = vals.max().reshape(1), dist.ReduceOp.MAX
            elif rule == "min":
                v, op = vals.min().reshape(1), dist.ReduceOp.MIN
            elif rule == "sum":
                v, op = vals.sum().reshape(1), dist.ReduceOp.SUM
            else:  # weighted mean: reduce (sum w*x, sum w) and divide at the end
                # Micro-batches without action tokens (weight 0) may report NaN means: drop them.
                x = torch.where(weights > 0, vals, torch.zeros_like(vals))
                v = torch.stack([(x * weights).sum(), weights.sum()])
                op = dist.ReduceOp.SUM
            if ctx.dp > 1:
                dist.all_reduce(v, op=op, group=ctx.dp_group)
            out[k] = (float(v[0] / v[1]) if rule == "mean" and v[1] > 0
                      else (float("nan") if rule == "mean" else float(v[0])))
        payload = [out]
    if ctx.pp > 1:
        dist.broadcast_object_list(payload, src=ctx.last_stage_rank, group=ctx.pp_group, device=ctx.device)
    return payload[0]
