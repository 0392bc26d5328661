"""`sao bench NAME [args]`: run a benchmark of the source checkout's benchmarks/ folder.

`main`, `ablations`, `staleness`, `online`, `throughput`, `dynamics` and `all` are the paper-reproduction
experiments (benchmarks/reproduce/); any other NAME runs benchmarks/bench_NAME.py (gae, actor_step,
mfu, rollout, sandbox, async_vs_sync). Benchmarks are not part of the installed package: they need
the checkout this package was installed from (`pip install -e .`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPRODUCE = ("main", "ablations", "staleness", "online", "throughput", "dynamics", "all")


def _checkout() -> Path:
    root = Path(__file__).resolve().parents[1]
    if not (root / "benchmarks").is_dir():
        raise SystemExit(f"sao bench: no benchmarks/ folder beside {root / 'megatron_sao'}; run from a source "
                         "checkout installed with `pip install -e .`")
    return root


def main(args) -> int:
    root = _checkout()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    if args.name in REPRODUCE:
        cmd = [sys.executable, "-m", "benchmarks.reproduce", args.name, *args.args]
    else:
        script = root / "benchmarks" / f"bench_{args.name}.py"
        if not script.exists():
            known = sorted(p.stem[len("bench_"):] for p in (root / "benchmarks").glob("bench_*.py"))
            raise SystemExit(f"sao bench: unknown benchmark {args.name!r}; known: {[*REPRODUCE, *known]}")
        cmd = [sys.executable, str(script), *args.args]
    return subprocess.call(cmd, cwd=root, env=env)
