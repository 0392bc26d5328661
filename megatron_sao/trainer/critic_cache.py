"""Pretrained critics kept per SFT model and pretraining settings (`value_pretrain.cache_dir`).

Value pretraining costs rollouts of the SFT policy and a fit; every seed of every experiment that
starts from the same SFT model should start from the same critic, so `sao value-pretrain` looks the
critic up before it rolls out and stores it after it fits. The key is the SFT policy's weights by
content (`checkpoint/digest.py`: a policy rebuilt bit for bit in another checkout hits the same
entry) and every setting that changes what the fit computes (`cache_settings`), so a changed
setting or policy is a miss, never a wrong critic. `VALUE_PRETRAIN_VERSION` is in the key too: bump
it when the stage's code starts computing a different critic from the same inputs.

An entry is `<cache_dir>/<key>/` holding the critic as an HF directory (`critic/`) and
`entry.json` (the key's inputs and the fit's summary); it appears atomically (temp dir + rename).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from megatron_sao.config import SAOConfig, to_dict

# 1: issue 35's stage: held-out split, early stop on held-out EV, the best critic kept.
VALUE_PRETRAIN_VERSION = 1


def cache_settings(cfg: SAOConfig) -> dict[str, Any]:
    """What determines the pretrained critic besides the policy's weights: the stage's settings (the
    cache's own location excluded), the critic's head, optimizer and freeze, the return targets, the
    task, the rollout sampling and the pretraining seed. Not the RL run's settings (actor, buffer,
    run.total_steps...), so runs that differ only there share one critic."""
    c = to_dict(cfg)
    vp = {k: v for k, v in c["value_pretrain"].items() if k not in ("cache_dir", "rollouts_file")}
    if cfg.value_pretrain.rollouts_file:  # the rollouts by content, wherever the file lies
        from megatron_sao.checkpoint.digest import file_digest

        vp["rollouts_file"] = file_digest(cfg.value_pretrain.rollouts_file)
    # The learning rates the fit runs at, whichever key set them (value_pretrain.lr or critic.optim.lr ...)
    fit = to_dict(cfg.value_pretrain_critic())
    vp = {k: v for k, v in vp.items() if k not in ("lr", "value_head_lr")}
    critic = {k: fit[k] for k in ("optim", "value_head_init", "value_head_bias", "value_head_lr")}
    if cfg.value_pretrain.apply_critic_freeze:
        critic["freeze"] = c["critic"]["freeze"]
    rollout = {k: c["rollout"][k] for k in ("backend", "max_turns", "max_total_tokens", "max_new_tokens_per_turn",
                                            "temperature", "top_p")}
    return {"version": VALUE_PRETRAIN_VERSION, "value_pretrain": vp, "critic": critic,
            "algorithm": {k: c["algorithm"][k] for k in ("gamma", "critic_lambda")},
            "env": {k: c["env"][k] for k in ("name", "train_data", "kwargs", "task_kwargs")},
            "rollout": rollout, "model": {k: c["model"][k] for k in ("dtype", "max_seq_len", "tokenizer")},
            "seed": c["run"]["seed"]}


def cache_key(policy_digest: str, settings: dict[str, Any]) -> str:
    """16 hex digits of sha256 over the policy digest and the settings (key order does not matter)."""
    if not policy_digest:
        raise ValueError("cache_key: the policy's digest is empty")
    blob = json.dumps({"policy": policy_digest, "settings": settings}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def lookup(cache_dir: str | Path, key: str) -> Path | None:
    """The cached critic's HF directory for `key`, or None."""
    critic = Path(cache_dir) / key / "critic"
    return critic if (Path(cache_dir) / key / "entry.json").is_file() and (critic / "config.json").is_file() else None


def store(cache_dir: str | Path, key: str, critic_dir: Path, entry: dict[str, Any]) -> Path:
    """Copy `critic_dir` into the cache under `key` with `entry` (JSON); atomic, and a no-op when
    another process stored the same key first (its critic is the same computation)."""
    root = Path(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / key
    tmp = root / f".{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        shutil.copytree(critic_dir, tmp / "critic")
        (tmp / "entry.json").write_text(json.dumps(entry, indent=1, default=str))
        try:
            os.rename(tmp, final)
        except OSError:
            if lookup(root, key) is None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final / "critic"
