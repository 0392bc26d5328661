"""Command line of the reproduction suite; see benchmarks/reproduce/__init__.py."""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from benchmarks.reproduce import ablations, dynamics, main_comparison, online, smollm2_main, staleness, throughput
from benchmarks.reproduce.experiment import Settings
from benchmarks.reproduce.runner import ROOT
from benchmarks.reproduce.starts import build_all

EXPERIMENTS = {"main": main_comparison, "ablations": ablations, "staleness": staleness, "online": online,
               "throughput": throughput, "dynamics": dynamics}
# Hours of runs with a committed result file each (--max-runs spreads them over sessions): not in `all`.
LONG = ("dynamics",)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sao bench", description=__import__("benchmarks.reproduce").reproduce.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", choices=[*EXPERIMENTS, "all"])
    ap.add_argument("--quick", action="store_true", help="tiny budgets, one seed: a pipeline check")
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="RL seeds (default 1 2 3; --quick: 1)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="runs at once, the cores split between them (default 2; --model smollm2: 1)")
    ap.add_argument("--model", choices=["toy", "smollm2"], default="toy",
                    help="main and online: smollm2 = on SmolLM2-135M-Instruct (smollm2_main.py; online.py)")
    ap.add_argument("--task", choices=list(smollm2_main.TASKS), default=None,
                    help="--model smollm2: the word problems (arith, default) or the arithmetic chains (chain)")
    ap.add_argument("--stress", action="store_true",
                    help="dynamics only: twice the lag and 4x the actor LR, where the ratios leave the DIS band "
                         "(results in results/reproduce/dynamics_stress/)")
    ap.add_argument("--switch-every", type=int, default=None,
                    help="online only: trainer steps per style phase (default 10; --quick: 1); results in a "
                         "folder of their own (online.py)")
    ap.add_argument("--actor-lr", type=float, default=None,
                    help="online only: the actor's LR (the critic's 5x it, the paper's ratio; default: the "
                         "recipe's); results in a folder of their own (online.py)")
    ap.add_argument("--entropy-coef", type=float, default=None,
                    help="online only: algorithm.entropy_coef, the entropy bonus in both methods' policy loss "
                         "(default: none, the paper's loss); results in a folder of their own (online.py)")
    ap.add_argument("--max-runs", type=int, default=None,
                    help="--model smollm2 and dynamics: train at most N of the missing runs, then write the report")
    ap.add_argument("--rows", nargs="+", default=None,
                    help="--model smollm2: train only the missing runs of these rows (e.g. sao_pretrained)")
    ap.add_argument("--out", default=None,
                    help="results folder (default results/reproduce, --quick: <work>/quick_results)")
    ap.add_argument("--work", default=None, help="runs and starting points (default runs/reproduce[_quick])")
    ap.add_argument("--fresh", action="store_true", help="run again even when a finished run is cached")
    args = ap.parse_args(argv)
    smollm2 = args.model == "smollm2"
    if smollm2 and args.experiment not in ("main", "online"):
        ap.error("--model smollm2: only the main comparison and the online experiment run on SmolLM2")
    if args.max_runs is not None and not (smollm2 or args.experiment in LONG):
        ap.error(f"--max-runs: only with --model smollm2 or {', '.join(LONG)} (their runs have per-run result files)")
    main_smollm2 = smollm2 and args.experiment == "main"
    if args.rows is not None and not main_smollm2:
        ap.error("--rows: only with main --model smollm2")
    if args.task is not None and not main_smollm2:
        ap.error("--task: only with main --model smollm2")
    task = args.task or "arith"
    if args.stress and args.experiment != "dynamics":
        ap.error("--stress: only with the dynamics experiment")
    for flag, value in (("--switch-every", args.switch_every), ("--actor-lr", args.actor_lr),
                        ("--entropy-coef", args.entropy_coef)):
        if value is not None and args.experiment != "online":
            ap.error(f"{flag}: only with the online experiment")
        if value is not None and not value > 0:
            ap.error(f"{flag}: must be positive, got {value}")
    seeds = args.seeds or ([1] if args.quick else smollm2_main.DEFAULT_SEEDS if smollm2 else [1, 2, 3])
    jobs = args.jobs or (1 if smollm2 and not args.quick else 2)
    work = Path(args.work or ROOT / ("runs/reproduce_quick" if args.quick else "runs/reproduce")).resolve()
    out_root = Path(args.out or (work / "quick_results" if args.quick else ROOT / "results" / "reproduce")).resolve()
    names = [n for n in EXPERIMENTS if n not in LONG] if args.experiment == "all" else [args.experiment]
    command = "sao bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    if args.experiment == "all":
        s = Settings("starts", args.quick, seeds, args.jobs, out_root, work, args.fresh, command)
        build_all(args.quick, work, s.budget.eval_size, s.log)
    rc = 0
    for experiment in names:
        name = (smollm2_main.TASKS[task].folder if main_smollm2 else "online_smollm2" if smollm2
                else "dynamics_stress" if args.stress else experiment)
        s = Settings(name, args.quick, seeds, jobs, out_root / name, work, args.fresh, command, max_runs=args.max_runs,
                     rows=args.rows, model=args.model, task=task, stress=args.stress,
                     switch_every=args.switch_every, actor_lr=args.actor_lr, entropy_coef=args.entropy_coef)
        if experiment == "online" and (suffix := online.design_suffix(s)):
            s = replace(s, name=name + suffix, out=out_root / (name + suffix))
        s.log(f"start: seeds {seeds}, {jobs} job(s), results in {s.out}")
        code = (smollm2_main if main_smollm2 else EXPERIMENTS[experiment]).run(s)
        s.log(f"{'done' if code == 0 else 'FAILED runs'}: {s.out / 'results.md'}")
        rc = rc or code
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
