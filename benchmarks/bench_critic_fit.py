"""How well a critic fits on the toy chain task: fresh, after the warm-up, after value pretraining, and
against the task's ceiling, for the zero and the normal value-head init (issue 35).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_critic_fit.py --json [--work runs/bench_critic_fit]
                                                                        [--config examples/toy_chain_cpu.yaml]

Every stage is the real CLI in a subprocess, on the toy model (examples/toy_chain_cpu.yaml: calculator
chains of 3-6 dependent calls, a wrong step answered ERR):
  1. `sao sft` -> the SFT policy (built once per work folder and reused: the slow part, ~5 min idle);
  2. `sao value-pretrain` with the zero head (the default): rollouts of the SFT policy, a held-out
     split, the fit with early stop on the held-out EV, and the oracle ceiling on the same held-out
     rollouts (trainer/oracle_value.py);
  3. `sao value-pretrain` with the normal head (N(0, 0.02), bias 0: the head before issue 35) on the
     same rollouts (`value_pretrain.rollouts_file`), so both inits see the same training and held-out
     trajectories.
Fields: `ev_step0_zero` / `ev_step0_normal` (held-out EV of the fresh critic), `ev_after_warmup_zero` /
`_normal` (after as many critic steps as the config's warm-up gives, critic_warmup_steps x critic_steps;
null when the fit stopped earlier), `ev_heldout_pretrained` (zero head, the critic kept) and
`ev_heldout_pretrained_normal`, `ev_ceiling` (the oracle's held-out EV), `ev_fraction_of_ceiling`
(ev_heldout_pretrained / ev_ceiling), and what it cost (seconds per stage, rollouts, the load).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sao(stage: str, config: str, *overrides: str, log: Path) -> tuple[dict | None, float, float]:
    """One `sao STAGE` subprocess: (its last stdout line as JSON when it is one, wall seconds, mean load)."""
    cmd = [sys.executable, "-m", "megatron_sao.cli", stage, config, "run.console=none", *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))}
    t0, loads = time.monotonic(), []
    log.parent.mkdir(parents=True, exist_ok=True)
    stdout = log.with_suffix(".stdout")
    with open(log, "w") as err, open(stdout, "w") as out:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err)
        while p.poll() is None:
            loads.append(os.getloadavg()[0])
            time.sleep(2.0)
    if p.returncode != 0:
        raise SystemExit(f"bench_critic_fit: `{' '.join(cmd)}` failed ({p.returncode}); see {log}")
    lines = stdout.read_text().strip().splitlines()
    try:
        last = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        last = None
    return last, time.monotonic() - t0, (sum(loads) / len(loads) if loads else os.getloadavg()[0])


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "value_pretrain" / "metrics.jsonl").read_text().splitlines()]


def ev_at(run_dir: Path, step: int) -> float | None:
    return next((r["heldout/explained_variance"] for r in rows(run_dir) if r["step"] == step), None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="examples/toy_chain_cpu.yaml")
    ap.add_argument("--work", default="runs/bench_critic_fit")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line")
    ap.add_argument("overrides", nargs="*", help="k=v overrides for every stage")
    args = ap.parse_args(argv)
    from megatron_sao.config import load_config

    cfg = load_config(ROOT / args.config, args.overrides)
    warmup_steps = cfg.algorithm.critic_warmup_steps * cfg.algorithm.critic_steps
    work = (ROOT / args.work).resolve()
    sft_dir, zero, normal = work / "sft", work / "zero", work / "normal"
    cost = {}
    if not (sft_dir / "sft_model" / "config.json").exists():
        _, cost["sft_s"], cost["sft_load"] = sao("sft", args.config, *args.overrides, f"run.dir={sft_dir}",
                                                 "sft.eval=false", log=sft_dir / "sft.log")
    policy = f"actor.init={sft_dir / 'sft_model'}"
    z, cost["pretrain_zero_s"], cost["pretrain_zero_load"] = sao(
        "value-pretrain", args.config, *args.overrides, f"run.dir={zero}", policy, "critic.value_head_init=zero",
        log=zero / "value_pretrain.log")
    n, cost["pretrain_normal_s"], cost["pretrain_normal_load"] = sao(
        "value-pretrain", args.config, *args.overrides, f"run.dir={normal}", policy, "critic.value_head_init=normal",
        "critic.value_head_bias=zero", f"value_pretrain.rollouts_file={zero / 'value_pretrain_rollouts.safetensors'}",
        log=normal / "value_pretrain.log")
    ceiling = (z.get("ceiling") or {}).get("explained_variance")
    ceiling = None if ceiling is None else float(ceiling)  # strict JSON names a non-finite number ("nan")
    out = {"ev_step0_zero": z["ev_step0"], "ev_step0_normal": n["ev_step0"],
           "ev_after_warmup_zero": ev_at(zero, warmup_steps), "ev_after_warmup_normal": ev_at(normal, warmup_steps),
           "warmup_critic_steps": warmup_steps,
           "ev_heldout_pretrained": z["ev_heldout_best"], "ev_heldout_pretrained_normal": n["ev_heldout_best"],
           "ev_ceiling": ceiling,
           "ev_fraction_of_ceiling": float(z["ev_heldout_best"]) / ceiling if ceiling and ceiling > 0 else None,
           "ev_ceiling_by_turn": {k: v for k, v in ((z.get("ceiling") or {}).get("fit") or {}).items()
                                  if k.startswith("ev_turn_")},
           "rollouts": z["rollouts"], "heldout_trajectories": z["heldout_trajectories"],
           "rollout_reward": z["rollout_reward"], "best_step_zero": z["best_step"], "best_step_normal": n["best_step"],
           "rollout_s": z["rollout_s"], "fit_zero_s": z["fit_s"], "fit_normal_s": n["fit_s"],
           **{k: round(v, 1) for k, v in cost.items()}, "config": args.config, "overrides": args.overrides}
    (work / "result.json").write_text(json.dumps(out, indent=1))
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:32s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
