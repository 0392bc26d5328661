"""Token sampling that returns the log-prob of the distribution actually sampled.

Shared by the HF engine and anything else that samples from raw logits in torch. The order is the one
vLLM uses (temperature, then top-k, then top-p) and the log-prob is taken from the *processed*
distribution (filtered tokens at -inf, renormalised), which is what vLLM's
``logprobs_mode="processed_logprobs"`` reports. With the SAO defaults (T=1, top-p=1, top-k off) it is
exactly ``log_softmax(logits)``.
"""

from __future__ import annotations

import torch

from megatron_sao.rollout.engines.protocol import SamplingParams


def processed_logprobs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Log-probs [..., V] of the distribution ``sampling`` samples from, computed in fp32."""
    x = logits.float()
    if sampling.temperature != 1.0:
        x = x / sampling.temperature
    vocab = x.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(x, sampling.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Drop a token once the mass of strictly more likely tokens already reaches top_p; the most
        # likely token is always kept so the distribution is never empty.
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= sampling.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def sample_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """Sample one id from 1-D ``logits``; return (id, log-prob under the processed distribution).

    Inverse-CDF sampling: ``generator`` draws one uniform number where it lives (a host generator for
    logits on a GPU: ``torch.multinomial`` would refuse the pair), which moves to the logits' device.
    Filtered tokens have probability 0, so the first CDF entry above the draw is always a kept token.
    """
    if logits.dim() != 1:
        raise ValueError(f"sample_token expects 1-D logits [V], got shape {tuple(logits.shape)}")
    logp = processed_logprobs(logits, sampling)
    cdf = torch.cumsum(logp.double().exp(), dim=-1)
    u = torch.rand((1,), generator=generator, dtype=torch.float64, device=generator.device)
    target = u.to(cdf.device) * cdf[-1]
    token = int(torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.numel() - 1).item())
    return token, float(logp[token].item())
