"""What one weight update costs: seconds per update over 1..N rollout servers, bytes/s against a local
memcpy of the same bytes, and the fixed cost of a tiny update, split by phase.

For each server kind and model it starts the largest server count once with the launch plan's own
commands (`launch_local.build_local_plan`, what `slurm/sao_aime.sh` runs) and updates the first n of
them (n = each count asked for) through the trainer's `WeightSync` and the server clients the trainer
builds (`make_engines(engine_config(cfg))`), the buckets made beforehand (the export's collectives are
not timed here: `tests/integration/megatron` covers them). Each count gets `--updates` updates, in two passes over
the counts (1, 2, 4, 1, 2, 4: the machine is shared, so a slow moment hits every count); the first
update of each count also forms its transfer group and is reported apart (`first_update_s`).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_weight_sync.py            # the default matrix
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_weight_sync.py --json --vllm 1,2 --sao '' --models tiny

Reported per (kind, model, n): the median seconds per update and its phases (`begin_s`: pause and
open the update on every server; `buckets_s`: every bucket broadcast and received; `finish_s`: the
version label, the layerwise-reload finalize and resume; `check_s`: the log-prob check of the
n=2 update that runs one, the last (warm) one; `first_check_s` the first, with the servers'
warm-up), bytes/s of the payload and a memcpy of the same tensors in this process, the sender's
broadcast calls per update (`sender_broadcasts`, from the shared transfer group: one per bucket on
gloo whatever n). `--json` prints one object: `fixed_cost_s` (tiny model, 2 vllm servers, no
check), `ratio_4_to_1` (update seconds with 4 vs 1 vllm servers, the largest model run at both),
`bytes_per_s_vs_memcpy_1` (that model with 1 vllm server), every row, the core count and the load.

``--vllm``: real `vllm serve` processes of the CPU build (~2 GiB each; weights over gloo);
``--sao``: rollout/engines/http_server.py servers (HF engine, weights as safetensors over HTTP).
Each server is pinned to one core, so on a 2-core machine 4 servers share 2 cores with the sender.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "tests" / "e2e" / "tiny_ci.yaml"
# About 100 MB of fp32 weights in the demo's architecture (26 M parameters, most in the experts).
MODEL_100MB = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   moe_intermediate_size=512, num_experts=16, num_experts_per_tok=2, intermediate_size=1024,
                   max_position_embeddings=256)
CHECK_TOKENS = [5, 9, 14, 20, 7, 11, 30, 3]


def make_model(name: str, out: Path) -> Path:
    from megatron_sao.models.builtin import materialize_builtin_model

    if name == "tiny":
        return materialize_builtin_model("tiny_qwen3_moe_ci", out / "tiny", seed=0)
    from megatron_sao.models.presets import tiny_hf_config, tiny_hf_model
    from megatron_sao.tokenizers.char_tokenizer import build_char_tokenizer

    d = out / name
    if not (d / "config.json").exists():
        tok = build_char_tokenizer()
        model = tiny_hf_model(tiny_hf_config("qwen3_moe", vocab_size=-(-len(tok) // 8) * 8, **MODEL_100MB), seed=0)
        model.save_pretrained(d, safe_serialization=True)
        tok.save_pretrained(d)
    return d


def make_buckets(state: dict, bucket_mb: int) -> list[list]:
    """The update as the trainer's export cuts it: buckets of at most `bucket_mb` MiB, in name order."""
    buckets, cur, size = [], [], 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > bucket_mb << 20:
            buckets.append(cur)
            cur, size = [], 0
        cur.append((name, t.contiguous()))
        size += nbytes
    return buckets + ([cur] if cur else [])


def memcpy_bytes_per_s(buckets: list[list], reps: int = 5) -> float:
    """A local copy of the same tensors into buffers allocated beforehand (the best a transport could do)."""
    import torch

    src = [t for b in buckets for _, t in b]
    dst = [torch.empty_like(t) for t in src]
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s)
        best = min(best, time.perf_counter() - t0)
    return sum(t.numel() * t.element_size() for t in src) / best


def reference_logprobs(model_dir: Path) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([CHECK_TOKENS])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[i - 1, CHECK_TOKENS[i]]) for i in range(1, len(CHECK_TOKENS))]


def sender_broadcasts(sync) -> int | None:
    """Broadcast calls the sender made so far (shared transfer group; None where there is none)."""
    group = getattr(sync, "group", None)
    return getattr(group, "broadcasts", None)


async def one_update(sync, buckets, version: int, reference: list[float] | None) -> dict:
    sent0 = sender_broadcasts(sync)
    t0 = time.perf_counter()
    await sync.begin(version)
    t1 = time.perf_counter()
    for b in buckets:
        await sync.send_bucket(b)
    t2 = time.perf_counter()
    kw = {}
    if reference is not None:
        kw = dict(check_tokens=CHECK_TOKENS, check_prompt_len=1, reference_logprobs=reference)
    sync.check = reference is not None
    m = await sync.finish(version, **kw)
    t3 = time.perf_counter()
    if m.failed:
        raise RuntimeError(f"update v{version} failed: {m.failed}")
    phases = getattr(m, "phase_seconds", {}) or {}
    check_s = phases.get("check", 0.0)
    out = {"seconds": t3 - t0, "begin_s": t1 - t0, "buckets_s": t2 - t1, "finish_s": t3 - t2 - check_s,
           "check_s": check_s, "bytes": m.bytes}
    sent1 = sender_broadcasts(sync)
    if sent0 is not None and sent1 is not None:
        out["sender_broadcasts"] = sent1 - sent0
    return out


def bench_kind(kind: str, model: str, counts: list[int], args, tmp: Path, loop) -> list[dict]:
    from safetensors.torch import load_file

    from megatron_sao.cluster.launch_local import build_local_plan
    from megatron_sao.cluster.supervisor import Supervisor
    from megatron_sao.config import load_config
    from megatron_sao.rollout.engines.factory import make_engines
    from megatron_sao.trainer.components import engine_config
    from megatron_sao.weights.sync import WeightSync

    model_dir = make_model(model, tmp / "models")
    nmax = max(counts)
    run = tmp / f"{kind}-{model}"
    overrides = [f"model.path={model_dir}", "rollout.timeout_s=300",
                 'rollout.vllm_serve_args=["--kv-cache-memory-bytes", "33554432", "--enforce-eager"]']
    plan = build_local_plan(str(CONFIG), trainer_ranks=1, rollout_servers=nmax, run_dir=str(run),
                            overrides=overrides, server=kind)
    cfg = load_config(str(CONFIG), [*overrides, *plan.plan.trainer_overrides])
    state = load_file(str(model_dir / "model.safetensors"))
    buckets = make_buckets(state, args.bucket_mb)
    nbytes = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
    memcpy = memcpy_bytes_per_s(buckets)
    reference = reference_logprobs(model_dir) if model == "tiny" else None
    rows = {n: [] for n in counts}
    firsts: dict[int, float] = {}
    with Supervisor(grace_s=20) as sup:
        t0 = time.monotonic()
        for s in plan.servers:
            sup.start(s.name, s.argv, s.log, s.env)
        sup.wait_healthy(plan.health, 900)
        print(f"# {kind} x{nmax} ({model}, {nbytes / 2**20:.1f} MiB, {len(buckets)} buckets): up in "
              f"{time.monotonic() - t0:.0f} s", flush=True)
        clients = make_engines(engine_config(cfg, model_dir))
        version = 0
        try:
            for _ in range(2):  # two passes over the counts
                for n in counts:
                    sync = WeightSync(clients[:n], cfg.rollout.timeout_s, strict=False)
                    for u in range(args.updates):
                        version += 1
                        check = reference if (args.check and n == 2 and u == args.updates - 1) else None
                        r = loop.run_until_complete(one_update(sync, buckets, version, check))
                        if n not in firsts:
                            firsts[n] = r["seconds"]
                            continue
                        r["check"] = check is not None
                        rows[n].append(r)
                    close = getattr(sync, "close", None)
                    if close is not None:
                        loop.run_until_complete(close())
        finally:
            async def close_all():
                await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
            loop.run_until_complete(close_all())
    out = []
    for n in counts:
        plain = [r for r in rows[n] if not r["check"]]
        med = lambda k, rs=plain: statistics.median(r[k] for r in rs)  # noqa: E731
        row = {"kind": kind, "model": model, "servers": n, "bytes": nbytes, "buckets": len(buckets),
               "updates": len(plain), "seconds": med("seconds"), "begin_s": med("begin_s"),
               "buckets_s": med("buckets_s"), "finish_s": med("finish_s"), "first_update_s": firsts[n],
               "memcpy_bytes_per_s": memcpy}
        row["bytes_per_s"] = nbytes / row["seconds"]
        row["vs_memcpy"] = row["bytes_per_s"] / memcpy
        if "sender_broadcasts" in plain[0]:
            row["sender_broadcasts"] = plain[0]["sender_broadcasts"]
            row["tensors"] = sum(len(b) for b in buckets)
        checked = [r for r in rows[n] if r["check"]]
        if checked:  # the first scoring request of a server is slow (warm-up): reported apart
            row["first_check_s"] = checked[0]["check_s"]
            row["check_s"] = checked[-1]["check_s"]
        out.append(row)
        print(f"{kind:4s} {model:5s} n={n}: {row['seconds'] * 1e3:8.1f} ms/update (begin {row['begin_s'] * 1e3:.0f}, "
              f"buckets {row['buckets_s'] * 1e3:.0f}, finish {row['finish_s'] * 1e3:.0f}; first "
              f"{row['first_update_s'] * 1e3:.0f}), {row['bytes_per_s'] / 1e6:.1f} MB/s = "
              f"{row['vs_memcpy']:.1%} of memcpy ({memcpy / 1e9:.2f} GB/s)"
              + (f", check {row['check_s'] * 1e3:.0f} ms" if checked else "")
              + (f", {row['sender_broadcasts']} sender broadcasts for {row['tensors']} tensors"
                 if "sender_broadcasts" in row else ""), flush=True)
    return out


def summary(rows: list[dict]) -> dict:
    def find(kind, model, n):
        return next((r for r in rows if (r["kind"], r["model"], r["servers"]) == (kind, model, n)), None)
    out: dict = {}
    fixed = find("vllm", "tiny", 2)
    if fixed:
        out["fixed_cost_s"] = fixed["seconds"]
        out["fixed_cost_breakdown_s"] = {k: fixed[k] for k in ("begin_s", "buckets_s", "finish_s")}
        if "check_s" in fixed:
            out["fixed_cost_check_s"] = fixed["check_s"]
    for model in ("100mb", "tiny"):
        one, four = find("vllm", model, 1), find("vllm", model, 4)
        if one and four:
            out["ratio_4_to_1"] = four["seconds"] / one["seconds"]
            out["ratio_4_to_1_model"] = model
            break
    for model in ("100mb", "tiny"):
        one = find("vllm", model, 1)
        if one:
            out["bytes_per_s_vs_memcpy_1"] = one["vs_memcpy"]
            out["bytes_per_s_vs_memcpy_1_model"] = model
            break
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm", default="1,2,4", help="vllm serve counts ('' for none)")
    p.add_argument("--sao", default="1,2,4,8", help="HF server counts ('' for none)")
    p.add_argument("--models", default="tiny,100mb")
    p.add_argument("--vllm-100mb", default="1,4", help="vllm serve counts for the 100 MB model (memory: ~2.5 GiB each)")
    p.add_argument("--sao-100mb", default="1", help="HF server counts for the 100 MB model")
    p.add_argument("--updates", type=int, default=4, help="updates per count and pass (the first is reported apart)")
    p.add_argument("--bucket-mb", type=int, default=32)
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the check-mode update (n=2)")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    args = p.parse_args()
    counts = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    load0 = os.getloadavg()
    print(f"# {os.cpu_count()} cores, load {load0[0]:.2f}; {args.updates} updates per count and pass", flush=True)
    loop = asyncio.new_event_loop()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in [m for m in args.models.split(",") if m]:
            for kind, c in (("vllm", args.vllm if model == "tiny" else args.vllm_100mb),
                            ("sao", args.sao if model == "tiny" else args.sao_100mb)):
                if counts(c):
                    rows.extend(bench_kind(kind, model, counts(c), args, Path(tmp), loop))
    loop.close()
    out = {**summary(rows), "cores": os.cpu_count(), "load_before": load0[0], "load_after": os.getloadavg()[0],
           "rows": rows}
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps({k: v for k, v in out.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
