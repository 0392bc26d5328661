"""`sao demo`: the whole method on a laptop CPU, as the three commands a user would type.

    sao sft examples/tiny_cpu.yaml             # warm start on demonstrations (30% contain an error)
    sao value-pretrain examples/tiny_cpu.yaml  # fit the critic on the SFT policy's rollouts
    sao train examples/tiny_cpu.yaml           # asynchronous single-rollout SAO

Each stage runs in its own process (each builds its own Megatron world), exactly as on a cluster.
At the end it prints the SFT starting accuracy and the accuracy after RL, both measured on the same
held-out tasks at temperature 1.0, and where to find metrics.jsonl and the TensorBoard logs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"


def _stage(name: str, config: str, overrides: list[str]) -> None:
    cmd = [sys.executable, "-m", "megatron_sao.cli", name, config, *overrides]
    print(f"\n=== sao {name} {config} {' '.join(overrides)}", flush=True)
    t0 = time.monotonic()
    rc = subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    if rc != 0:
        raise SystemExit(f"sao demo: stage `{name}` failed with exit code {rc}")
    print(f"=== {name} done in {time.monotonic() - t0:.0f} s", flush=True)


def main(args) -> int:
    from megatron_sao.config import load_config

    config = args.config or str(DEFAULT_CONFIG)
    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"run.dir={args.run_dir}")
    cfg = load_config(config, overrides)
    run = Path(cfg.run.dir)
    t0 = time.monotonic()
    print("megatron-sao CPU demo: tiny Qwen3-MoE-shaped model, toy multi-turn calculator task,\n"
          f"run directory {run} (metrics.jsonl, tensorboard/, checkpoints/)", flush=True)
    _stage("sft", config, overrides)
    _stage("value-pretrain", config, overrides)
    _stage("train", config, overrides)
    sft_acc = json.loads((run / "sft" / "eval.json").read_text())["accuracy"]
    evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval/accuracy" in r]
    final = evals[-1]["eval/accuracy"] if evals else float("nan")
    print(f"\nSFT starting point: eval accuracy {sft_acc:.3f}\n"
          f"after {cfg.run.total_steps} SAO steps: eval accuracy {final:.3f} "
          f"(held-out tasks, Pass@1 at temperature 1.0)\n"
          f"total {time.monotonic() - t0:.0f} s. TensorBoard: tensorboard --logdir {run / 'tensorboard'}", flush=True)
    return 0
