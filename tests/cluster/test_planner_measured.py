"""`sao plan`'s trainer peak against the peak a real train step reaches on CPU (workers/train_step_peak.py):
weights, gradients and Adam state of actor and critic, the log-prob stage's logits, activations (with
and without full recompute), the batch and the RoPE cache, within 10%."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.paths import REPO

WORKER = "tests.cluster.workers.train_step_peak"

pytestmark = pytest.mark.slow  # a subprocess that builds and trains two engines


@pytest.mark.parametrize("recompute", ["full", "none"])
def test_planned_trainer_peak_is_within_10_percent_of_the_measured_one(recompute):
    # Every allocation over 64 KiB gets its own mmap, so the resident set follows the live tensors.
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run([sys.executable, "-m", WORKER, recompute], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("PEAK "))[5:])
    assert r["logits_gib"] > 0.25 * r["measured_gib"]  # the log-prob stage is a large part of what is checked
    assert abs(r["planned_gib"] - r["measured_gib"]) <= 0.10 * r["measured_gib"], r
