"""Micro-batch column trimming: widths agree across DP ranks and never cut a real token."""

import torch

from megatron_sao.megatron.batching import prepare_local_batch


def batch_of(lengths, T=12):
    mask = torch.tensor([[1] * n + [0] * (T - n) for n in lengths], dtype=torch.bool)
    tokens = torch.arange(len(lengths) * T, dtype=torch.int64).reshape(len(lengths), T) * mask
    return {"tokens": tokens, "attention_mask": mask, "action_mask": mask}


def test_trimmed_widths_take_the_max_over_dp_ranks():
    b = batch_of([3, 4, 9, 2, 5, 6, 2, 3])  # dp=2, micro 2: rank0 rows 0-3, rank1 rows 4-7
    r0, *_ = prepare_local_batch(b, dp=2, dp_rank=0, micro_batch_size=2, seq_multiple=1, trim=True)
    r1, *_ = prepare_local_batch(b, dp=2, dp_rank=1, micro_batch_size=2, seq_multiple=1, trim=True)
    assert [m["tokens"].shape[1] for m in r0] == [6, 9] == [m["tokens"].shape[1] for m in r1]
    full, *_ = prepare_local_batch(b, dp=2, dp_rank=0, micro_batch_size=2, seq_multiple=1)
    for t, f in zip(r0, full):  # nothing real was cut
        w = t["tokens"].shape[1]
        assert torch.equal(t["tokens"], f["tokens"][:, :w]) and not f["attention_mask"][:, w:].any()


def test_trimmed_widths_respect_the_sequence_parallel_multiple():
    micro, *_ = prepare_local_batch(batch_of([3, 5]), dp=1, dp_rank=0, micro_batch_size=1, seq_multiple=4, trim=True)
    assert [m["tokens"].shape[1] for m in micro] == [4, 8]
