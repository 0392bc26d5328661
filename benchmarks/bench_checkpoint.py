"""How long a training checkpoint blocks the trainer, written synchronously or asynchronously, and how long a
load that reshards takes against one at the layout that saved it.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_checkpoint.py --json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_checkpoint.py --json --models smollm2 --rounds 3

Models (random weights, fp32, built from their configs; nothing is downloaded): `smollm2`, the shape of
SmolLM2-135M (Llama, 30 layers, hidden 576, vocabulary 49152, tied; 0.54 GB of weights), and `1gb`, a Llama of
254 M parameters (1.02 GB of weights). A checkpoint holds the weights, the fp32 main weights and both Adam
moments (megatron/optimizer_state.py): four times the weights.

Save (one rank, TP 1; the engine has taken one optimizer step, so Adam's state exists): the trainer's own
path, `trainer/checkpoints.py::Checkpointer.save` with the engine's `save` (megatron/dist_state.py), commit and
manifest included, into a checkpoint root that keeps two as the trainer's does. One synchronous and one
asynchronous save first (reported apart as `first_*`: the first save of a process also starts the writers'
results queue), then `--rounds` rounds of one synchronous and one asynchronous save, interleaved.
`sync_block_s`: the seconds `save` took (every shard written, committed). `async_block_s`: the seconds `save`
took before returning (planning, common part, writer fork); `async_commit_s`: from the start of the save
until the commit, the writer's time included (nothing else runs meanwhile here; in a run the next steps
do). `async_block_ratio` = median async_block_s / median sync_block_s (the goal is <= 0.2).

Load (two ranks, PP 2: SmolLM2's 9 heads rule out TP 2): the engine loads the checkpoint it saved itself
(`load_same_layout_s`) and the one the one-rank engine saved (`load_reshard_s`, PP 1 -> PP 2: each rank
reads its stage's half of the checkpoint), interleaved over `--rounds` rounds; `reshard_load_ratio` =
median reshard / median same-layout.

The machine is shared: every figure comes with the load average before and after (`load_before`,
`load_after`) and the core count; compare ratios taken in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, tie_word_embeddings=True, max_position_embeddings=2048,
               rope_parameters={"rope_type": "default", "rope_theta": 1e5})
GB1 = dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16,
           num_key_value_heads=8, head_dim=64, tie_word_embeddings=False, max_position_embeddings=2048,
           rope_parameters={"rope_type": "default", "rope_theta": 1e4})
MODELS = {"smollm2": SMOLLM2, "1gb": GB1}


def stats(xs: list[float]) -> dict:
    return {"min": round(min(xs), 3), "median": round(statistics.median(xs), 3), "max": round(max(xs), 3),
            "n": len(xs)}


# ------------------------------------------------------------------ worker side (torchrun)
def _engine(model: str, pp: int):
    import torch

    from megatron_sao.megatron.cpu_compat import ensure_cpu_compat

    torch.set_num_threads(1)
    ensure_cpu_compat()
    from megatron_sao.megatron.engine import InitSource, MegatronEngine
    from megatron_sao.megatron.optimizer import OptimConfig
    from megatron_sao.megatron.parallel import init_parallel
    from megatron_sao.models.hf_config import model_spec_from_hf
    from megatron_sao.models.parallel_sizes import ParallelSizes
    from megatron_sao.models.presets import tiny_hf_config

    spec = model_spec_from_hf(tiny_hf_config("llama", **MODELS[model]))
    sizes = ParallelSizes(pp=pp)
    engine = MegatronEngine(spec, sizes, OptimConfig(lr=1e-4), role="actor", init=InitSource.random(0),
                            micro_batch_size=2, ctx=init_parallel(sizes))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=g)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    batch = {"tokens": tokens, "attention_mask": mask, "action_mask": mask}
    engine.train_step(batch, lambda out, mb, d: (-(out * mb["action_mask"]).sum() / d, {}))  # Adam's state exists
    return engine


def _checkpointer(root: Path, asynchronous: bool):
    import torch.distributed as dist

    from megatron_sao.megatron.async_saves import AsyncSaves
    from megatron_sao.trainer.checkpoints import Checkpointer

    def broadcast(obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return Checkpointer(root, is_writer=dist.get_rank() == 0, asynchronous=asynchronous, barrier=dist.barrier,
                        broadcast=broadcast, gate=lambda what: None, saves=AsyncSaves() if asynchronous else None)


def worker_save(model: str, out: Path, rounds: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    engine = _engine(model, pp=1)
    root = out / "root"
    root.mkdir(parents=True, exist_ok=True)
    savers = {False: _checkpointer(root, False), True: _checkpointer(root, True)}
    step = 0
    rows: dict[str, list[float]] = {"sync_block_s": [], "async_block_s": [], "async_commit_s": []}
    first = {}
    for r in range(rounds + 1):
        for asynchronous in (False, True):
            step += 1
            saver = savers[asynchronous]

            def parts(d: Path) -> list:
                req = engine.save(str(d / "actor"), asynchronous=asynchronous)
                return [req] if req is not None else []
            t0 = time.monotonic()
            blocked = saver.save(step, parts, {"step": step, "rng": None}, lambda previous: None)
            saver.wait()
            committed = time.monotonic() - t0
            kind = "async" if asynchronous else "sync"
            if r == 0:
                first[f"first_{kind}_block_s"] = round(blocked, 3)
            else:
                rows[f"{kind}_block_s"].append(blocked)
                if asynchronous:
                    rows["async_commit_s"].append(committed)
    engine.save(str(out / "pp1" / "actor"))  # the checkpoint the PP 2 load phase reshards
    if dist.get_rank() == 0:
        size = sum(p.stat().st_size for p in (out / "pp1" / "actor").iterdir())
        params = sum(p.numel() for p in engine.module.parameters())
        (out / "save.json").write_text(json.dumps({"params": params, "checkpoint_bytes": size, **first,
                                                   **{k: stats(v) for k, v in rows.items()}}))
    dist.destroy_process_group()


def worker_load(model: str, out: Path, rounds: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    engine = _engine(model, pp=2)
    engine.save(str(out / "pp2" / "actor"))
    rows: dict[str, list[float]] = {"load_same_layout_s": [], "load_reshard_s": []}
    for _ in range(rounds):
        for key, path in (("load_same_layout_s", out / "pp2"), ("load_reshard_s", out / "pp1")):
            dist.barrier()
            t0 = time.monotonic()
            engine.load(str(path / "actor"))
            rows[key].append(time.monotonic() - t0)
    if dist.get_rank() == 0:
        (out / "load.json").write_text(json.dumps({k: stats(v) for k, v in rows.items()}))
    dist.destroy_process_group()


# ------------------------------------------------------------------ driver
def _torchrun(nproc: int, *args: str) -> None:
    exe = Path(sys.executable).parent / "torchrun"
    launcher = [str(exe)] if os.access(exe, os.X_OK) else [sys.executable, "-m", "torch.distributed.run"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([*launcher, "--nproc_per_node", str(nproc), "--standalone", __file__, *args], env=env,
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"worker {args} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")


def run_model(model: str, rounds: int, base: Path) -> dict:
    out = base / model
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    _torchrun(1, "--worker", "save", "--model", model, "--out", str(out), "--rounds", str(rounds))
    _torchrun(2, "--worker", "load", "--model", model, "--out", str(out), "--rounds", str(rounds))
    save, load = json.loads((out / "save.json").read_text()), json.loads((out / "load.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    return {**save, **load,
            "async_block_ratio": round(save["async_block_s"]["median"] / save["sync_block_s"]["median"], 3),
            "reshard_load_ratio": round(load["load_reshard_s"]["median"] / load["load_same_layout_s"]["median"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--models", default="smollm2,1gb", help=f"comma-separated, of {sorted(MODELS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    ap.add_argument("--worker", choices=["save", "load"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        (worker_save if args.worker == "save" else worker_load)(args.model, Path(args.out), args.rounds)
        return
    models = [m for m in args.models.split(",") if m]
    unknown = set(models) - set(MODELS)
    if unknown:
        raise SystemExit(f"unknown --models {sorted(unknown)}; known: {sorted(MODELS)}")
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench_checkpoint_"))
    load0 = os.getloadavg()[0]
    results = {}
    for m in models:
        try:
            results[m] = run_model(m, args.rounds, base)
        except SystemExit as e:  # a worker died (on a shared machine: the OOM killer); the other models still run
            results[m] = {"error": str(e)[-600:]}
        print(f"{m}: {json.dumps(results[m])}", file=sys.stderr, flush=True)
    out = {"models": results, "cores": os.cpu_count(), "load_before": load0, "load_after": os.getloadavg()[0],
           "rounds": args.rounds}
    if args.json:
        print(json.dumps(out))
        return
    for m, r in results.items():
        if "error" in r:
            print(f"{m}: failed: {r['error']}")
            continue
        print(f"{m}: {r['params'] / 1e6:.0f} M params, checkpoint {r['checkpoint_bytes'] / 2**30:.2f} GiB")
        print(f"  save blocks: sync {r['sync_block_s']['median']:.2f} s, async {r['async_block_s']['median']:.2f} s "
              f"(ratio {r['async_block_ratio']}; async committed after {r['async_commit_s']['median']:.2f} s)")
        print(f"  load: same layout {r['load_same_layout_s']['median']:.2f} s, resharded TP 1 -> 2 "
              f"{r['load_reshard_s']['median']:.2f} s (ratio {r['reshard_load_ratio']})")
    print(f"load average {out['load_before']:.1f} -> {out['load_after']:.1f} on {out['cores']} cores")


if __name__ == "__main__":
    main()
