"""Which styles a policy writes on the style-shift task: `--n` answers sampled at T=1 (HF generate, seeded)
to the task's prompts, each classified by the rule judge (envs/style_judges.py: the style it adheres to,
or none). An SFT start for `sao bench online` should write every style: the first phase's reward starts
at that style's share.

    PYTHONPATH=. .venv/bin/python benchmarks/style_mix.py runs/smollm2/style/sft_model --n 128
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="an HF model directory (e.g. <run.dir>/sft_model)")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_sao.envs.style_judges import STYLES, RuleBasedStyleJudge
    from megatron_sao.envs.style_shift import load_style_tasks

    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tasks = load_style_tasks(args.n, seed=args.seed + 123)
    prompts = [tok.apply_chat_template(tasks[i].messages, tokenize=False, add_generation_prompt=True)
               for i in range(args.n)]
    judge = RuleBasedStyleJudge()
    counts: collections.Counter[str] = collections.Counter()
    examples: dict[str, str] = {}
    for i in range(0, args.n, args.batch):
        enc = tok(prompts[i: i + args.batch], return_tensors="pt", padding=True)
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id)
        for row in out:
            text = tok.decode(row[enc["input_ids"].shape[1]:], skip_special_tokens=True)
            style = next((s for s in STYLES if judge.adheres(text, s)), "none")
            counts[style] += 1
            examples.setdefault(style, text)
    print(json.dumps({"n": args.n, "share": {s: counts[s] / args.n for s in (*STYLES, "none")},
                      "examples": examples}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
