"""Vocabulary padding, as Megatron-LM does it (`_vocab_size_with_padding`).

Megatron shards the embedding and the LM head by vocabulary rows over tensor parallelism, so the
row count must divide by TP; Megatron-LM also rounds it up to a multiple of 128 for GEMM-friendly
shapes. The padded size is `ceil(V / (128 * TP)) * 128 * TP`: GPT-2's 50257 becomes 50304 at TP 1,
50432 at TP 2 (4 x 128 = 512: 50688 at TP 4).

Where the padding lives (so that nothing outside the model sees it):
* the Megatron model is built with `padded_vocab_size(V, TP)` rows;
* `checkpoint.sharding.shard_tensor` pads the full (HF-sized) tensor with zero rows before slicing
  it, and `unshard_tensor` strips them again, so HF checkpoints, the offline Megatron format's
  full tensors, HF export and weight sync all carry exactly V rows;
* `megatron.logprobs.vocab_parallel_logprobs` leaves the padding columns out of the vocab-parallel
  log-softmax, so they never enter a log-prob (and get no gradient: the rows stay zero).
"""

from __future__ import annotations

VOCAB_DIVISIBLE_BY = 128  # Megatron-LM's --make-vocab-size-divisible-by default


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Rows of the Megatron embedding / LM head for a real vocabulary of `vocab_size` at TP `tp`."""
    if vocab_size < 1 or tp < 1 or divisible_by < 1:
        raise ValueError(f"padded_vocab_size needs positive sizes, got vocab_size={vocab_size} tp={tp} "
                         f"divisible_by={divisible_by}")
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple
