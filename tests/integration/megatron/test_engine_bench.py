"""The MFU benchmark runs at --tiny size on CPU and prints an MFU figure."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.paths import REPO


@pytest.mark.slow
def test_bench_mfu_tiny_prints_mfu():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_mfu.py"), "--tiny", "--steps", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = re.search(r"MFU ([0-9.eE+-]+)% of 989 TFLOP/s peak", proc.stdout)
    assert m is not None, proc.stdout
    assert float(m.group(1)) > 0.0
    assert re.search(r"active params [0-9,]+", proc.stdout)
