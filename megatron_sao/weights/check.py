"""rollout.weight_sync_check: the fixed tokens every engine scores after an update, and the actor's reference.

After a weight update every engine's log-probs of the same tokens must equal the actor's (pitfall 3,
silent MoE refit corruption). Under routing replay the actor's reference is computed with the experts
the engine chose for those tokens, one row per engine: for an MoE a route flip between the two stacks
(precision, kernels) is routing noise, not a transfer error, and every other forward that scores
rollout tokens replays the engine's routes too. The actor is any engine with ``logprobs(batch)`` (the
Megatron actor: megatron/engine.py), called on every trainer rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_sao.trajectory import stack_routes


def check_tokens(vocab: int) -> list[int]:
    """The fixed tokens every engine must score like the actor after an update (scored from position 1)."""
    return torch.randint(1, vocab, (24,), generator=torch.Generator().manual_seed(0)).tolist()


def check_reference(actor, tokens: list[int], routes: Sequence[torch.Tensor] | None = None) -> list[list[float]]:
    """The actor's log-probs of ``tokens[1:]`` (every rank: a forward): one row, or under routing replay one
    per engine, with that engine's routes of ``tokens`` ([T, layers, topk] expert ids) replayed."""
    rows = 1 if routes is None else len(routes)
    t = torch.tensor([tokens] * rows, dtype=torch.long)
    batch = {"tokens": t, "attention_mask": torch.ones_like(t, dtype=torch.bool)}
    if routes is not None:
        batch["routes"] = stack_routes(list(routes), len(tokens))
    return actor.logprobs(batch)[:, 1:].float().cpu().tolist()
