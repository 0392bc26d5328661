"""One SAO run's critic, as the result files of issue 35 keep it: per step EV (overall and by turn), value
mean against return mean, value loss, grad norms; the warm-up's EV; EV and training reward over the first
10 actor steps; held-out accuracy at each evaluation. Read from the run directory, written as one JSON.

    PYTHONPATH=. .venv/bin/python benchmarks/critic_run_summary.py runs/critic35/sao_pre_s1 \\
        --what "..." --command "..." --sft-accuracy 0.273 --out results/critic_fit/smollm2_arith/<name>.json

`--command` is what made the run (kept verbatim). The machine's load while it ran is the caller's to give
(`--load`): the run directory does not record it. `wall_s` spans the trainer steps (the first step's
time plus the wall time from its end to the last step's end), not the start-up before them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_sao.trainer.checkpoints import atomic_write_text  # noqa: E402
from megatron_sao.trainer.run_dir import jsonable  # noqa: E402

CRITIC_KEYS = ("critic/explained_variance", "critic/value_mean", "critic/return_mean", "critic/loss",
               "critic/grad_norm", "critic/grad_norm/mlp", "critic/grad_norm/attention", "critic/grad_norm/value_head")


def _r(x):
    return round(x, 5) if isinstance(x, float) else x


def summarize(run_dir: Path) -> dict:
    """The run's critic figures (see the module docstring); raises if the run has no metrics."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"critic_run_summary: {path} does not exist (not a run directory?)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    warmup, batch = cfg["algorithm"]["critic_warmup_steps"], cfg["buffer"]["batch_size"]
    steps = []
    for r in rows:
        keys = [k for k in r if k in CRITIC_KEYS or k.startswith("critic/ev_turn_")]
        steps.append({"step": r["step"], "actor_step": r["step"] - warmup if r["step"] >= warmup else None,
                      "reward": _r(r["reward"]), **{k: _r(float(r[k])) for k in keys},
                      "step_time_s": _r(r.get("step_time_s"))})
    actor = [s for s in steps if s["actor_step"] is not None][:10]
    ev = [s.get("critic/explained_variance") for s in actor]
    return {
        "eval": {f"after_{(r['step'] + 1) * batch}_trajectories": r["eval/accuracy"] for r in rows
                 if "eval/accuracy" in r} | {"n": cfg["env"]["eval_size"]},
        "warmup_ev": [s.get("critic/explained_variance") for s in steps if s["actor_step"] is None],
        "actor_steps_0_9": {"ev": ev, "reward": [s["reward"] for s in actor],
                            "ev_above_0": sum(e is not None and e > 0 for e in ev)},
        "wall_s": rows[-1]["wall_time"] - rows[0]["wall_time"] + rows[0].get("step_time_s", 0.0) if rows else 0.0,
        "steps": steps,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--what", required=True, help="one sentence: what the run is")
    ap.add_argument("--command", required=True, help="the command that made the run")
    ap.add_argument("--sft-accuracy", type=float, help="the starting policy's held-out accuracy")
    ap.add_argument("--load", default="not recorded", help="the machine's load while it ran")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    out = {"what": args.what, "command": args.command, "commit": commit, "sft_heldout_accuracy": args.sft_accuracy,
           **summarize(args.run_dir), "load_avg": args.load}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(jsonable(out), indent=1, allow_nan=False) + "\n")
    a = out["actor_steps_0_9"]
    print(f"{args.out}: EV over actor steps 0-9 {[round(e, 2) for e in a['ev'] if e is not None]} "
          f"({a['ev_above_0']} above 0); eval {out['eval']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
