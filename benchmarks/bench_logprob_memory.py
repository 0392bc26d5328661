"""Peak memory of the actor's log-prob stage (forward + backward of log p(label) from the LM head's
logits), before and after the chunked vocab-parallel log-softmax (megatron/logprobs.py), in one run.

    .venv/bin/python benchmarks/bench_logprob_memory.py [--seq 8192] [--vocab 151936] [--tp 1 2] [--json]

"before" is the path megatron/forward.py took until the chunked one replaced it: an fp32 copy of the
logits, the padded vocabulary masked with masked_fill (a second copy, on the TP rank that holds the
padding), megatron-core's vocab_parallel_cross_entropy (its fp32 exp-logits saved for the backward).
Each variant runs in a fresh process on one TP rank's shard: [seq, padded_vocab/TP] bf16 logits, the
last TP rank's (the one with the padding rows) at TP > 1; the all-reduces over the TP group do not
change a rank's memory, so a 1-rank group stands in for them. The figure is the process's peak RSS
(ru_maxrss) during the stage minus its peak RSS once the logits, labels and loss weights exist,
i.e. what the stage adds on top of the logits the LM head produced; the stage's seconds, as a ratio;
and the planner's logits term (cluster/memory.py::logits_bytes) against the logits plus that figure.
"entropy" is the chunked pass with the entropy bonus's gradient too (algorithm.entropy_coef: a loss on
the log-probs and on the entropy): its stage memory and its seconds against "after".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

GIB = 2**30


def _rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(variant: str, seq: int, vocab: int, tp: int) -> dict:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from megatron_sao.megatron.cpu_compat import ensure_cpu_compat
    from megatron_sao.models.vocab import padded_vocab_size

    ensure_cpu_compat()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()
    padded = padded_vocab_size(vocab, tp)
    per_rank = padded // tp
    valid = vocab - (tp - 1) * per_rank  # the last TP rank: its real columns, then the padding
    torch.manual_seed(0)
    logits = torch.randn(seq, per_rank, dtype=torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, valid, (seq,))
    weights = torch.randn(seq)
    base = _rss_peak()
    t0 = time.perf_counter()
    if variant == "before":
        from megatron.core import tensor_parallel

        x = logits.float()
        if valid < per_rank:
            x = x.masked_fill(torch.arange(per_rank) >= valid, float("-inf"))
        lp = -tensor_parallel.vocab_parallel_cross_entropy(x.contiguous()[None], labels[None])[0]
        del x
    else:
        from megatron_sao.megatron.logprobs import vocab_parallel_logprobs

        if variant == "after":
            lp = vocab_parallel_logprobs(logits, labels, valid)
        else:  # "entropy": the bonus's gradient flows through the same backward
            lp, entropy = vocab_parallel_logprobs(logits, labels, valid, with_entropy=True)
            lp = lp + 0.01 * entropy
    (lp * weights).sum().backward()
    seconds = time.perf_counter() - t0
    peak = _rss_peak()
    from megatron_sao.cluster.memory import logits_bytes
    from megatron_sao.megatron.logprobs import chunk_tokens_for

    chunk = chunk_tokens_for(logits.device, per_rank)  # the chunk this CPU ran, not a GPU's
    return {"variant": variant, "seq": seq, "vocab": vocab, "tp": tp, "logits_gib": logits.numel() * 2 / GIB,
            "planned_gib": logits_bytes(padded, seq, 1, tp, dtype_bytes=2, chunk_tokens=chunk) / GIB,
            "stage_peak_gib": (peak - base) / GIB, "stage_s": seconds, "logprob_sum": float(lp.detach().sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", nargs=4, metavar=("VARIANT", "SEQ", "VOCAB", "TP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        variant, seq, vocab, tp = args.child
        print(json.dumps(child(variant, int(seq), int(vocab), int(tp))))
        return
    rows = []
    for tp in args.tp:
        pair = {}
        for variant in ("before", "after", "entropy"):
            out = subprocess.run([sys.executable, __file__, "--child", variant, str(args.seq), str(args.vocab),
                                  str(tp)], capture_output=True, text=True, check=True).stdout
            pair[variant] = json.loads(out.strip().splitlines()[-1])
        b, a, e = pair["before"], pair["after"], pair["entropy"]
        rows.append({"tp": tp, "seq": args.seq, "vocab": args.vocab, "logits_gib": round(b["logits_gib"], 3),
                     "before_gib": round(b["stage_peak_gib"], 3), "after_gib": round(a["stage_peak_gib"], 3),
                     "ratio": round(a["stage_peak_gib"] / b["stage_peak_gib"], 3),
                     "time_ratio": round(a["stage_s"] / b["stage_s"], 3),
                     "entropy_gib": round(e["stage_peak_gib"], 3),
                     "entropy_time_ratio": round(e["stage_s"] / a["stage_s"], 3),
                     # the planner's term (cluster/memory.py::logits_bytes) against logits + what the stage added
                     "planned_gib": round(a["planned_gib"], 3),
                     "measured_gib": round(a["logits_gib"] + a["stage_peak_gib"], 3),
                     "logprob_sum_rel_diff": abs(a["logprob_sum"] - b["logprob_sum"]) / abs(b["logprob_sum"])})
    if args.json:
        print(json.dumps(rows))
        return
    for r in rows:
        print(f"TP {r['tp']}  S={r['seq']}  V={r['vocab']}: logits {r['logits_gib']:.2f} GiB (bf16, one rank); "
              f"log-prob stage adds {r['before_gib']:.2f} GiB before, {r['after_gib']:.2f} GiB after "
              f"(x{r['ratio']:.3f}); time x{r['time_ratio']:.2f}; with the entropy bonus's gradient "
              f"{r['entropy_gib']:.3f} GiB, time x{r['entropy_time_ratio']:.2f} of after; sum of log-probs agrees to "
              f"{r['logprob_sum_rel_diff']:.1e}; planner {r['planned_gib']:.2f} GiB vs measured "
              f"{r['measured_gib']:.2f} GiB (logits + stage)")


if __name__ == "__main__":
    main()
