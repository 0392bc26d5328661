"""The multi-node path on one machine: the launcher starts a rollout HTTP server process and two
trainer ranks (torchrun, gloo); the trainer reaches the server through the same client it uses
for `vllm serve`, pushes weights to it over HTTP after every actor step, and trains end to end."""

import json
import subprocess
import sys

import pytest

from tests.paths import REPO

CONFIG = REPO / "tests" / "e2e" / "tiny_ci.yaml"


@pytest.mark.slow
def test_two_trainer_ranks_and_a_rollout_server(tmp_path):
    run = tmp_path / "local"
    p = subprocess.run([sys.executable, "-m", "megatron_sao.cluster.launch_local", "--config", str(CONFIG),
                        "--trainer-ranks", "2", "--rollout-servers", "1", "--run-dir", str(run),
                        "--health-timeout-s", "300", "run.total_steps=2", "trainer.mode=sync"],
                       capture_output=True, text=True, timeout=900)
    logs = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted((run / "logs").glob("*.log")))
    assert p.returncode == 0, p.stderr[-2000:] + logs
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["version"] == 1
    # Sync mode: the batch after the first weight push was sampled by the server with the pushed
    # weights, and the two trainer ranks (data parallel) score its tokens identically.
    assert rows[-1]["lag_histogram"] == {"0": 8}
    assert rows[-1]["logprob_mismatch_lag0"] < 1e-4
    assert (run / "logs" / "rollout-local-0.log").exists() and (run / "logs" / "trainer-local.log").exists()
