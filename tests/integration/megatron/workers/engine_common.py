"""Shared pieces of the engine test workers: tiny HF model on disk, batch, losses, JSON output."""

from __future__ import annotations

import json
import os

import torch

from megatron_sao.megatron.cpu_compat import ensure_cpu_compat

torch.set_num_threads(1)
ensure_cpu_compat()

from megatron_sao.models.hf_config import model_spec_from_hf  # noqa: E402
from megatron_sao.models.presets import tiny_hf_config, tiny_hf_model  # noqa: E402


def tiny_model_dir(path: str, arch: str = "qwen3_moe", **overrides):
    """(spec, HF model) of a tiny model (default the Qwen3-MoE); rank 0 saves it to `path` if absent."""
    cfg = tiny_hf_config(arch, **overrides)
    hf = tiny_hf_model(cfg, seed=0)
    rank = int(os.environ.get("RANK", 0))
    if rank == 0 and not os.path.isfile(os.path.join(path, "config.json")):
        hf.save_pretrained(path)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return model_spec_from_hf(cfg), hf


def make_batch(vocab: int, rows: int = 5, cols: int = 11, seed: int = 7) -> dict[str, torch.Tensor]:
    """Right-padded batch with ragged lengths and action masks (rows not a multiple of 2)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, cols), generator=g)
    lengths = [cols - (i % 4) for i in range(rows)]
    attn = torch.zeros(rows, cols, dtype=torch.bool)
    for i, n in enumerate(lengths):
        attn[i, :n] = True
    action = attn.clone()
    action[:, :4] = False
    return dict(tokens=tokens, attention_mask=attn, action_mask=action,
                rollout_logprobs=-4.8 + 0.1 * torch.randn(rows, cols, generator=g),
                advantages=torch.randn(rows, cols, generator=g), returns=torch.randn(rows, cols, generator=g))


def hf_logprobs(hf, batch) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(input_ids=batch["tokens"]).logits.float()
    lp = torch.log_softmax(logits, dim=-1)[:, :-1].gather(-1, batch["tokens"][:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1) * batch["attention_mask"]


def nll_loss(out, mb, denom):
    """Token-mean negative log-likelihood over action tokens (global denominator)."""
    m = mb["action_mask"].float()
    return -(out * m).sum() / denom, {"action_count": m.sum()}


def mse_loss(out, mb, denom):
    m = mb["action_mask"].float()
    return 0.5 * ((out - mb["returns"]) ** 2 * m).sum() / denom, {"action_count": m.sum()}


def emit(tag: str, payload: dict) -> None:
    """One parseable line per result: RESULT <tag> <json>."""
    print(f"RESULT {tag} {json.dumps(payload)}", flush=True)
