"""Asynchronous vs synchronous SAO on a long-tailed workload: trajectories/s and trainer idle time.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_async_vs_sync.py [--steps 12] [--latency 0.05]
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_async_vs_sync.py --from-run runs/demo
        # start from the demo's SFT model + critic

Both modes run the same `sao train` (same model, engine, environment and seed); only
`trainer.mode` differs. The toy calculator's tool calls wait `latency * X` seconds with
X ~ Pareto(1.5) (capped at 100), so a few trajectories take far longer than the rest, which is
where a synchronous barrier leaves the trainer waiting. Each mode runs in its own process, one
after the other, so the two numbers come from one invocation on the same machine. Printed:
trajectories trained per second of training wall time (first step excluded: start-up), trainer
idle fraction, rollout engine idle fraction, reward, and eval accuracy when evaluated.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "tests" / "e2e" / "tiny_ci.yaml"


def run_mode(mode: str, run_dir: Path, args) -> dict:
    overrides = [f"run.dir={run_dir}", f"trainer.mode={mode}", f"run.total_steps={args.steps}",
                 "algorithm.critic_warmup_steps=0", f"buffer.batch_size={args.batch}",
                 f"rollout.concurrency={args.batch * 2}", f"parallel.micro_batch_size={args.batch}",
                 "buffer.staleness_policy=keep", "buffer.max_staleness=2", "run.console=none",
                 f"env.kwargs={{tool_latency_s: {args.latency}, latency_tail: 1.5}}",
                 f"run.eval_every={args.steps}", "env.eval_size=64", "run.tensorboard=false"]
    if args.from_run:
        src = Path(args.from_run)
        overrides += [f"actor.init={src / 'sft_model'}", f"critic.init={src / 'critic_pretrained'}",
                      "model.max_seq_len=160", "rollout.max_total_tokens=160", "rollout.max_new_tokens_per_turn=24",
                      "rollout.max_turns=6", "env.task_kwargs={n: 100000, max_ops: 4}"]
    cmd = [sys.executable, "-m", "megatron_sao.cli", "train", str(args.config), *overrides]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if p.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{p.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = rows[1:]  # the first step includes start-up (engine build, first rollouts)
    span = timed[-1]["wall_time"] - rows[0]["wall_time"]
    trajs = sum(r["action_tokens"] > 0 for r in timed) * args.batch
    return {"mode": mode, "steps": len(rows), "trajectories_per_s": trajs / span, "wall_s": time.monotonic() - t0,
            "trainer_idle_fraction": rows[-1]["trainer_idle_fraction"],
            "rollout_idle_fraction": rows[-1]["rollout_idle_fraction"],
            "reward_last5": sum(r["reward"] for r in rows[-5:]) / len(rows[-5:]),
            "eval_accuracy": next((r["eval/accuracy"] for r in reversed(rows) if "eval/accuracy" in r), None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--latency", type=float, default=0.05, help="tool latency scale in seconds")
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--from-run", default=None, help="a demo run dir: start from its sft_model and critic")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        res = {m: run_mode(m, Path(d) / m, args) for m in ("sync", "async")}
    print(f"{'mode':6s} {'traj/s':>8s} {'trainer idle':>13s} {'rollout idle':>13s} "
          f"{'reward(last5)':>14s} {'eval':>6s} {'wall s':>7s}")
    for r in res.values():
        ev = f"{r['eval_accuracy']:.3f}" if r["eval_accuracy"] is not None else "-"
        print(f"{r['mode']:6s} {r['trajectories_per_s']:8.2f} {r['trainer_idle_fraction']:13.2f} "
              f"{r['rollout_idle_fraction']:13.2f} {r['reward_last5']:14.3f} {ev:>6s} {r['wall_s']:7.0f}")
    print(f"async / sync throughput: {res['async']['trajectories_per_s'] / res['sync']['trajectories_per_s']:.2f}x")


if __name__ == "__main__":
    main()
