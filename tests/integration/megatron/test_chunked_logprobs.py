"""megatron/logprobs.py against log_softmax of the masked fp32 logits, values and gradients, for chunk
sizes from one token to the whole batch, and its entropy (value and gradient) against the full softmax's.
One process (no TP group), and the entropy once at TP 2 (a torchrun worker; one case gives a rank a shard of padding
only); the multi-rank engine tests run the log-probs under TP 2 and 4 against the HF model
(tests/integration/megatron/test_engine_parallel.py, models_equivalence)."""

import math
import os
import subprocess

import pytest
import torch

from megatron_sao.megatron.forward import token_logprobs
from megatron_sao.megatron.logprobs import vocab_parallel_logprobs
from tests.integration.megatron.result_lines import parse_tagged
from tests.launch import torchrun_cmd


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


def reference_entropy(logits, vocab_size):
    x = logits.float()
    if vocab_size is not None:
        x = x[..., :vocab_size]
    p = torch.softmax(x, dim=-1)
    return -(p * torch.log_softmax(x, dim=-1)).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 10_000])
@pytest.mark.parametrize("vocab_size", [None, 50])
def test_entropy_matches_the_full_softmax_and_leaves_the_logprobs_and_gradient_unchanged(dtype, chunk, vocab_size):
    torch.manual_seed(2)
    b, s, v = 3, 37, 64
    base = (torch.randn(b, s, v) * 3).to(dtype)
    base[0, 0] = -30.0  # a row with a uniform distribution: entropy log(V)
    base[0, 0, 5] = 60.0  # ... made one-hot: entropy ~0 (exp underflows to 0 off the peak)
    base[1, 1] = 0.0
    labels = torch.randint(0, vocab_size or v, (b, s))
    weights = torch.randn(b, s)

    def run(with_entropy):
        logits = base.clone().requires_grad_(True)
        out = vocab_parallel_logprobs(logits, labels, vocab_size, chunk_tokens=chunk, with_entropy=with_entropy)
        lp = out[0] if with_entropy else out
        (lp * weights).sum().backward()
        return out, logits.grad

    (lp, ent), grad = run(True)
    plain_lp, plain_grad = run(False)
    want = reference_entropy(base, vocab_size)
    assert ent.dtype == torch.float32
    assert torch.allclose(ent, want, atol=1e-5, rtol=0), (ent - want).abs().max()
    ent = ent.detach()
    assert float(ent[0, 0]) < 1e-5 and float(ent[1, 1]) == pytest.approx(math.log(vocab_size or v), abs=1e-5)
    assert torch.equal(lp, plain_lp) and torch.equal(grad, plain_grad)  # an unused entropy changes nothing else


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 10_000])
@pytest.mark.parametrize("vocab_size", [None, 50])
@pytest.mark.parametrize("uses_logprobs", [True, False])
def test_the_entropy_gradient_matches_autograd_through_the_full_softmax(dtype, chunk, vocab_size, uses_logprobs):
    """The entropy bonus differentiates the entropy: alone, or beside the log-probs' own gradient."""
    torch.manual_seed(4)
    b, s, v = 3, 37, 64
    base = (torch.randn(b, s, v) * 3).to(dtype)
    base[0, 0] = -30.0
    base[0, 0, 5] = 60.0  # a one-hot row: p underflows to 0 off the peak, and its gradient must stay finite
    labels = torch.randint(0, vocab_size or v, (b, s))
    w_lp, w_ent = torch.randn(b, s), torch.randn(b, s)

    def run(fn):
        logits = base.clone().requires_grad_(True)
        lp, ent = fn(logits)
        loss = (ent * w_ent).sum() + ((lp * w_lp).sum() if uses_logprobs else 0.0)
        loss.backward()
        return logits.grad.float()

    got = run(lambda x: vocab_parallel_logprobs(x, labels, vocab_size, chunk_tokens=chunk, with_entropy=True))
    want = run(lambda x: (reference_logprobs(x, labels, vocab_size), reference_entropy(x, vocab_size)))
    assert torch.isfinite(got).all()
    atol, rtol = (1e-5, 0) if dtype == torch.float32 else (1e-2, 1e-2)  # bf16: one ulp of the rounded gradient
    assert torch.allclose(got, want, atol=atol, rtol=rtol), (got - want).abs().max()
    if vocab_size is not None:
        assert torch.count_nonzero(got[..., vocab_size:]) == 0


def test_token_logprobs_shifts_the_entropy_like_the_logprobs():
    torch.manual_seed(3)
    logits = torch.randn(2, 9, 16)
    tokens = torch.randint(0, 16, (2, 9))
    lp, ent = token_logprobs(logits, tokens, with_entropy=True)
    assert torch.equal(lp, token_logprobs(logits, tokens))
    assert torch.equal(ent[:, 0], torch.zeros(2))
    assert torch.allclose(ent[:, 1:], reference_entropy(logits, None)[:, :-1], atol=1e-5)


@pytest.mark.slow  # a torchrun subprocess pair
def test_entropy_and_logprobs_at_tp2_match_the_full_softmax(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    worker = "tests.integration.megatron.workers.chunked_entropy_tp"
    p = subprocess.run(torchrun_cmd(2, "-m", worker), cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    results = parse_tagged(p.stdout)
    assert len(results) == 12, sorted(results)
    for tag, r in results.items():
        full, labels, vocab = torch.tensor(r["full"]), torch.tensor(r["labels"]), r["vocab"]
        got_ent, got_lp = torch.tensor(r["entropy"]), torch.tensor(r["logprobs"])
        assert torch.allclose(got_ent, reference_entropy(full, vocab), atol=1e-5, rtol=0), tag
        assert torch.allclose(got_lp, reference_logprobs(full, labels, vocab), atol=1e-5, rtol=0), tag
        x = full.to(torch.bfloat16 if "bfloat16" in tag else torch.float32).requires_grad_(True)
        w_lp, w_ent = torch.tensor(r["w_lp"]), torch.tensor(r["w_ent"])
        ((reference_logprobs(x, labels, vocab) * w_lp).sum() + (reference_entropy(x, vocab) * w_ent).sum()).backward()
        # bf16: both gradients are rounded to bf16, one ulp apart at most (2^-6 at |g| ~ 2)
        atol, rtol = (1e-2, 1e-2) if "bfloat16" in tag else (1e-5, 0)
        assert torch.allclose(torch.tensor(r["grad"]), x.grad.float(), atol=atol, rtol=rtol), tag
