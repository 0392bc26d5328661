"""megatron/logprobs.py against log_softmax of the masked fp32 logits, values and gradients, for chunk
sizes from one token to the whole batch. One process (no TP group); the multi-rank engine tests run
it under TP 2 and 4 against the HF model (tests/megatron/test_engine_parallel.py, models_equivalence)."""

import pytest
import torch

from megatron_sao.megatron.forward import token_logprobs
from megatron_sao.megatron.logprobs import vocab_parallel_logprobs


def reference_logprobs(logits, labels, vocab_size):
    x = logits.float()
    if vocab_size is not None:
        x = x.masked_fill(torch.arange(x.shape[-1]) >= vocab_size, float("-inf"))
    return torch.log_softmax(x, dim=-1).gather(-1, labels[..., None]).squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
@pytest.mark.parametrize("vocab_size", [None, 50])  # 50 of 64 columns real: 14 padding rows
def test_values_and_gradients_match_both_references(dtype, chunk, vocab_size):
    torch.manual_seed(0)
    b, s, v = 3, 37, 64
    base = (torch.randn(b, s, v) * 3).to(dtype)
    labels = torch.randint(0, vocab_size or v, (b, s))
    weights = torch.randn(b, s)

    def run(fn):
        logits = base.clone().requires_grad_(True)
        lp = fn(logits, labels)
        (lp * weights).sum().backward()
        return lp.detach(), logits.grad.float()

    got, got_grad = run(lambda x, y: vocab_parallel_logprobs(x, y, vocab_size, chunk_tokens=chunk))
    want, want_grad = run(lambda x, y: reference_logprobs(x, y, vocab_size))
    atol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: both gradients are rounded to bf16
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-5, rtol=0)
    assert torch.allclose(got_grad, want_grad, atol=atol, rtol=0)
    if vocab_size is not None:
        assert torch.count_nonzero(got_grad[..., vocab_size:]) == 0  # padding rows get no gradient


def test_the_forward_leaves_fp32_logits_untouched_and_token_logprobs_shift_by_one():
    torch.manual_seed(1)
    logits = torch.randn(2, 9, 16)
    before = logits.clone()
    tokens = torch.randint(0, 16, (2, 9))
    lp = token_logprobs(logits, tokens)
    assert torch.equal(logits, before)  # megatron-core's cross entropy subtracts in place; this does not
    want = torch.log_softmax(before, -1)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    assert torch.equal(lp[:, 0], torch.zeros(2)) and torch.allclose(lp[:, 1:], want, atol=1e-6)
