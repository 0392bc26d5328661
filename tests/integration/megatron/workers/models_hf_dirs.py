"""Write the tiny HF test checkpoints (actor per arch, plus a Qwen3 critic) used by the model and
conversion tests. Importable (make_hf_dirs) and runnable:
python -m tests.integration.megatron.workers.models_hf_dirs OUT_DIR."""

from __future__ import annotations

import os
import sys

import torch
from transformers import AutoModelForTokenClassification

from megatron_sao.models.presets import tiny_hf_config, tiny_hf_model

ARCHS = ("qwen3_moe", "qwen3", "llama")
TOKENIZER_FILES = {  # stand-ins for real tokenizer files: conversion must copy them byte for byte
    "tokenizer_config.json": '{"model_max_length": 256, "chat_template": "{{ messages }}"}\n',
    "special_tokens_map.json": '{"eos_token": "<|im_end|>"}\n',
    "merges.txt": "#version: 0.2\nh e\n",
}


def make_hf_dirs(root: str) -> dict[str, str]:
    """{name: dir} for the three actors and 'qwen3_critic' (Qwen3ForTokenClassification, num_labels=1)."""
    torch.set_num_threads(1)
    dirs = {}
    for i, arch in enumerate(ARCHS):
        path = os.path.join(root, arch)
        tiny_hf_model(tiny_hf_config(arch), seed=i).save_pretrained(path)
        for name, text in TOKENIZER_FILES.items():
            with open(os.path.join(path, name), "w") as f:
                f.write(text)
        dirs[arch] = path
    cfg = tiny_hf_config("qwen3", num_labels=1)
    cfg.architectures = ["Qwen3ForTokenClassification"]
    torch.manual_seed(5)
    critic = AutoModelForTokenClassification.from_config(cfg, dtype=torch.float32)
    path = os.path.join(root, "qwen3_critic")
    critic.save_pretrained(path)
    dirs["qwen3_critic"] = path
    return dirs


if __name__ == "__main__":
    print(make_hf_dirs(sys.argv[1]))
