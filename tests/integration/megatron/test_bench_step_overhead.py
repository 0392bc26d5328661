"""`benchmarks/bench_step_overhead.py` on the tiny model: its JSON carries every round's ratio with the
spread, and `--phases` a per-phase table whose parts add up to the step it splits.

No timing is asserted (the machine is shared): the test checks the benchmark's bookkeeping, which is
what the README's figures rest on.
"""

import json
import os
import subprocess
import sys

from tests.paths import REPO


def test_bench_step_overhead_reports_rounds_and_phases():
    cmd = [sys.executable, "benchmarks/bench_step_overhead.py", "--model", "tiny", "--batch", "4", "--seq", "32",
           "--micro-batch-size", "2", "--rounds", "2", "--steps", "2", "--phases", "--clock", "cpu", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["rounds"] == 2 and out["steps"] == 2 and len(out["load_avg"]) == 3
    for role in ("actor", "critic"):
        rounds = out[f"{role}_ratio_rounds"]
        assert len(rounds) == 2 and all(r > 0 for r in rounds)
        assert out[f"{role}_ratio_min"] == min(rounds) and out[f"{role}_ratio_max"] == max(rounds)
        assert out[f"{role}_ratio_min"] <= out[f"{role}_ratio"] <= out[f"{role}_ratio_max"]
        for side in ("engine", "plain"):
            s = out[f"{side}_{role}_s"]
            assert 0 < s["min"] <= s["median"] <= s["max"]
        table = out["phases"][role]
        # every layer's attention and MLP ran forward and backward on both sides: the hooks found them
        for phase in ("norms", "attention", "mlp", "head", "optimizer"):
            assert table[phase][0] > 0 and table[phase][1] > 0, (role, phase, table)
        # "forward other" is the remainder of the forward+backward: the timed phases cannot exceed it
        assert all(v[0] > -1e-3 and v[1] > -1e-3 for v in table.values()), table
    # the actor's head is the LM head; its log-prob pass is the loss phase, timed on both sides
    assert out["phases"]["actor"]["loss"][0] > 0 and out["phases"]["actor"]["loss"][1] > 0
