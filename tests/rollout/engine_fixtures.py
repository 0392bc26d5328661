"""Tiny random Qwen3 (dense, and dense with tied embeddings) and Qwen3-MoE checkpoints with a char-level
tokenizer, for engine tests.

head_dim is 32 because vLLM's CPU attention has no kernel for 16. Everything is fp32 so log-probs can be
compared with a transformers forward to 1e-4.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

VOCAB = 256
EOS_ID = 1


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]
    vocab = {"<unk>": 0, "<|endoftext|>": EOS_ID, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


def make_tiny_model(root: str | os.PathLike, kind: str, seed: int = 0) -> Path:
    """Save a random ``kind`` ("dense" | "tied" | "moe") model + tokenizer under ``root/kind``; return the
    dir. "tied" is "dense" with tied input/output embeddings (no ``lm_head.weight`` in the checkpoint), as
    SmolLM2 and the small Llama/Qwen models have."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=512, bos_token_id=EOS_ID, eos_token_id=EOS_ID,
        pad_token_id=EOS_ID, tie_word_embeddings=kind == "tied", rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    if kind == "moe":
        cfg = Qwen3MoeConfig(
            intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[], **common,
        )
        model = Qwen3MoeForCausalLM(cfg)
    elif kind in ("dense", "tied"):
        model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=128, **common))
    else:
        raise ValueError(f"kind must be 'dense', 'tied' or 'moe', got {kind!r}")
    # Random init is small; larger weights make the distribution peaky enough that tests see real changes.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    out = Path(root) / kind
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    _tokenizer().save_pretrained(out)
    return out


def load_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The on-disk (HF checkpoint) state dict of a saved tiny model."""
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


def perturbed(state: dict[str, torch.Tensor], seed: int, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """A clearly different set of weights with the same names/shapes (what a training step would send)."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * v.float().std().clamp_min(1e-3) * torch.randn(v.shape, generator=g) for k, v in state.items()}


@torch.no_grad()
def hf_logprobs(model_dir: str | os.PathLike, state: dict[str, torch.Tensor] | None, prompt: list[int],
                tokens: list[int], temperature: float = 1.0) -> list[float]:
    """Reference log-probs of ``tokens`` after ``prompt`` from a fresh fp32 transformers forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if state is not None:
        from megatron_sao.rollout.engines.hf_weights import WeightTargets, apply_update, plan_update

        apply_update(plan_update(WeightTargets(model), [list(state.items())]))
    logits = model(torch.tensor([prompt + tokens])).logits[0].float() / temperature
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
