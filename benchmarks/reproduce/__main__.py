"""Command line of the reproduction suite; see benchmarks/reproduce/__init__.py."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from benchmarks.reproduce import ablations, main_comparison, online, staleness, throughput
from benchmarks.reproduce.experiment import Settings
from benchmarks.reproduce.runner import ROOT
from benchmarks.reproduce.starts import build_all

EXPERIMENTS = {"main": main_comparison, "ablations": ablations, "staleness": staleness, "online": online,
               "throughput": throughput}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sao bench", description=__import__("benchmarks.reproduce").reproduce.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", choices=[*EXPERIMENTS, "all"])
    ap.add_argument("--quick", action="store_true", help="tiny budgets, one seed: a pipeline check")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="RL seeds (default 1 2 3; --quick: 1)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (the cores are split between them)")
    ap.add_argument("--out", default=None,
                    help="results folder (default results/reproduce, --quick: <work>/quick_results)")
    ap.add_argument("--work", default=None, help="runs and starting points (default runs/reproduce[_quick])")
    ap.add_argument("--fresh", action="store_true", help="run again even when a finished run is cached")
    args = ap.parse_args(argv)
    seeds = args.seeds or ([1] if args.quick else [1, 2, 3])
    work = Path(args.work or ROOT / ("runs/reproduce_quick" if args.quick else "runs/reproduce")).resolve()
    out_root = Path(args.out or (work / "quick_results" if args.quick else ROOT / "results" / "reproduce")).resolve()
    names = list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    command = "sao bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    if args.experiment == "all":
        s = Settings("starts", args.quick, seeds, args.jobs, out_root, work, args.fresh, command)
        build_all(args.quick, work, s.budget.eval_size, s.log)
    rc = 0
    for name in names:
        s = Settings(name, args.quick, seeds, args.jobs, out_root / name, work, args.fresh, command)
        s.log(f"start: seeds {seeds}, {args.jobs} job(s), results in {s.out}")
        code = EXPERIMENTS[name].run(s)
        s.log(f"{'done' if code == 0 else 'FAILED runs'}: {s.out / 'results.md'}")
        rc = rc or code
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
