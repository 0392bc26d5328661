"""Built-in models that need no download: a Qwen3-MoE-shaped model a 2-core laptop trains in minutes,
and its smallest version for tests; written as an HF directory with the character tokenizer."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# name -> (architecture preset, overrides). The demo model is Qwen3-MoE-shaped (q/k norm, GQA, top-k
# routed experts).
BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    "tiny_qwen3_moe": dict(arch="qwen3_moe", hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, moe_intermediate_size=128, num_experts=4,
                           num_experts_per_tok=2, intermediate_size=256, max_position_embeddings=512),
    # The same shape at the smallest size that still exercises everything (tests, CI).
    "tiny_qwen3_moe_ci": dict(arch="qwen3_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, moe_intermediate_size=64, num_experts=4,
                              num_experts_per_tok=2, intermediate_size=128, max_position_embeddings=256),
}


def is_builtin(path: str) -> bool:
    return path in BUILTIN_MODELS


# Which built-in (and seed) a materialized directory holds: a run folder's base_model/ is reused only
# for the same one (an --overwrite with another built-in, or another seed, rebuilds it).
BUILTIN_RECORD = "sao_builtin.json"


def materialize_builtin_model(name: str, out_dir: str | os.PathLike, seed: int) -> Path:
    """Write a randomly initialised built-in model + the char tokenizer as an HF directory (kept when
    it already holds this built-in at this seed, rebuilt when it holds another or says nothing)."""
    from megatron_sao.models.presets import tiny_hf_config, tiny_hf_model
    from megatron_sao.tokenizers.char_tokenizer import build_char_tokenizer

    out = Path(out_dir)
    record = {"name": name, "seed": seed}
    if (out / "config.json").exists():
        try:
            held = json.loads((out / BUILTIN_RECORD).read_text())
        except (OSError, ValueError):
            held = None
        if held == record:
            return out
        logger.warning("%s holds %s, not built-in %s at seed %d: building it anew", out,
                       f"built-in {held.get('name')} at seed {held.get('seed')}" if isinstance(held, dict)
                       else "a model with no built-in record", name, seed)
    spec = dict(BUILTIN_MODELS[name])
    arch = spec.pop("arch")
    tok = build_char_tokenizer()
    # Pad the vocabulary to a multiple of 8 (like Megatron's make-vocab-size-divisible-by) so that
    # tensor parallelism can split it; the extra rows are never produced by the tokenizer.
    hf_config = tiny_hf_config(arch, vocab_size=-(-len(tok) // 8) * 8, **spec)
    model = tiny_hf_model(hf_config, seed=seed)
    # Written aside and renamed: a trainer and a rollout server may materialize it at once.
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / BUILTIN_RECORD).write_text(json.dumps(record) + "\n")
    if out.exists():  # another built-in's (or seed's): set aside first (a directory is not replaced over)
        stale = out.parent / f".{out.name}.stale-{os.getpid()}"
        try:
            os.replace(out, stale)
        except OSError:  # another process set it aside already
            pass
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(tmp, out)
    except OSError:  # the other process won the race; its copy is identical (same seed)
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model_dir(path: str, run_dir: Path, seed: int) -> Path:
    """`model.path` as an HF directory: a built-in is materialized into `<run_dir>/base_model` (seeded)."""
    if is_builtin(path):
        return materialize_builtin_model(path, run_dir / "base_model", seed)
    p = Path(path)
    if not (p / "config.json").exists():
        from megatron_sao.errors import MissingInputError

        raise MissingInputError(f"model.path: {p} is neither a built-in model ({sorted(BUILTIN_MODELS)}) "
                                "nor an HF directory with config.json")
    return p
