"""`sbatch slurm/sao_aime.sh` on a real SLURM cluster: munged, slurmctld and two slurmd on this machine.

The cluster is tools/slurm_local/cluster.py (nodes sao-n1, sao-n2; `make test` installs Debian's
slurm-wlm and munge through tools/slurm_local/install.sh). The jobs run the CPU recipes of
examples/slurm_cpu/ (the tiny Qwen3-MoE-shaped model, vLLM's CPU build, gloo transfer groups) with
the venv's python, torchrun and vLLM, exactly as a user submits them (docs/cluster.md, "Trying the
launcher on one machine"):

- colocated: one node, two trainer ranks each hosting a vLLM engine shard; completes. A plain `scancel`
  of the same job mid-run: checkpoint after the step, the job ends (CANCELLED), no requeue.
- disaggregated: a trainer node of two ranks, a rollout node of two `vllm serve`, started together (the
  trainer polls the servers' /health itself; `rollout.start_min_servers=0` holds the first episodes
  until both serve, or the tiny run could end on the first server before the second has loaded). Then
  one server is SIGKILLed and the other frozen (no server in service: the run waits); the node restarts
  the killed one, the trainer readmits it with its current weights and it serves. It is frozen in turn
  (the run waits again, so the time-limit signal cannot come after the last step), the time-limit
  signal is sent (`scancel --signal=USR1 --batch`) and both are thawed: checkpoint, requeue under the
  same id and run dir, resume, completion with every step logged once and no trajectory trained twice.
  The weight check runs at every update: each server that took it scores as the trainer does.

Without the SLURM programs the tests fail in CI (CI=true) and skip elsewhere. A requeued job starts
again after the cluster's credential lifetime (cred_expire=10 here, SLURM's default 120 s).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_sao.distributed.ports import free_port_block
from tests.paths import REPO
from tools.slurm_local.cluster import ClusterError, SlurmCluster, missing_tools

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
RECIPES = REPO / "examples" / "slurm_cpu"
CHECK_ATOL = 1e-3  # the weight check's tolerance: fp32 on both sides, measured differences ~1e-6
VENV_PY = sys.executable


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = missing_tools()
    if missing:
        why = f"no SLURM here ({', '.join(missing)} missing): run `bash tools/slurm_local/install.sh` as root"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
    except ClusterError as e:
        pytest.fail(f"the SLURM cluster did not come up: {e}")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The recipes' built-in model as the HF directory vllm serve loads (SAO_MODEL_DIR)."""
    from megatron_sao.config import load_config
    from megatron_sao.models.builtin import resolve_model_dir

    d = tmp_path_factory.mktemp("model")
    cfg = load_config(RECIPES / "disaggregated.yaml")
    return resolve_model_dir(cfg.model.path, d, cfg.run.seed)


def _job_env(slurm: SlurmCluster, run_root: Path, config: Path, model_dir: Path, **extra: str) -> dict:
    return {**slurm.env(), "SAO_REPO": str(REPO), "SAO_CONFIG": str(config), "SAO_PYTHON": VENV_PY,
            "SAO_TORCHRUN": f"{VENV_PY} -m torch.distributed.run",
            "SAO_VLLM": f"{VENV_PY} -m vllm.entrypoints.openai.api_server",
            # the trailing slash is on purpose: vLLM must serve the name the trainer asks for
            "SAO_MODEL_DIR": f"{model_dir}/", "SAO_RUN_ROOT": str(run_root), "SAO_POLL_S": "1",
            "SAO_KILL_GRACE_S": "60", "SAO_HEALTH_TIMEOUT_S": "400", "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


def _ports() -> list[str]:
    """This machine is shared: the recipe's ports (8000, 29500, 29600) may be taken."""
    rollout = free_port_block(2)
    master = free_port_block(1, avoid=[rollout, rollout + 1])
    sync = free_port_block(2, avoid=[rollout, rollout + 1, master])
    return [f"cluster.rollout_port={rollout}", f"cluster.master_port={master}", f"cluster.weight_sync_port={sync}"]


def _submit(slurm: SlurmCluster, env: dict, nodes: int, out: Path, *overrides: str) -> str:
    p = subprocess.run(["sbatch", "--parsable", f"--nodes={nodes}", "--gpus-per-node=0", f"--output={out}",
                        str(REPO / "slurm" / "sao_aime.sh"), *overrides],
                       env=env, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip().split(";")[0]


def _job(slurm: SlurmCluster, job: str) -> dict:
    p = subprocess.run(["scontrol", "-o", "show", "job", job], env=slurm.env(), capture_output=True, text=True,
                       timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", p.stdout))


def _wait(slurm: SlurmCluster, job: str, until, timeout_s: float, what: str, out: Path) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        info = _job(slurm, job)
        if until(info):
            return info
        if time.monotonic() > deadline or info.get("JobState") in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            raise AssertionError(f"job {job}: {what} not reached ({info.get('JobState')}, "
                                 f"Restarts={info.get('Restarts')})\n{_diagnose(slurm, out)}")
        time.sleep(1)


def _done(info: dict) -> bool:
    return info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _diagnose(slurm: SlurmCluster, out: Path) -> str:
    parts = [f"--- {out.name}\n{out.read_text(errors='replace')[-4000:]}" if out.exists() else f"no {out}"]
    for f in sorted(out.parent.glob("**/logs/*.log")):
        parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}")
    return "\n".join(parts) + "\n" + slurm.logs_tail(1500)


def test_colocated_job_completes(slurm, model_dir, tmp_path):
    env = _job_env(slurm, tmp_path / "runs", RECIPES / "colocated.yaml", model_dir)
    out = tmp_path / "job.out"
    job = _submit(slurm, env, 1, out, _ports()[1])
    info = _wait(slurm, job, _done, 600, "the end of the job", out)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", _diagnose(slurm, out)
    run = tmp_path / "runs" / f"sao-aime-{job}"
    rows = _rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2], _diagnose(slurm, out)  # critic warm-up + 2 steps
    assert all(n > 0 for n in rows[-1]["rollout/episodes_by_server"].values()), rows[-1]
    assert (run / "final_model" / "config.json").exists()


def test_plain_scancel_checkpoints_and_ends(slurm, model_dir, tmp_path):
    """`scancel <job>` (docs/cluster.md, section 4): SIGTERM to every process of the job; the trainer
    finishes its step, writes a checkpoint and exits, and the job ends without a requeue."""
    env = _job_env(slurm, tmp_path / "runs", RECIPES / "colocated.yaml", model_dir)
    out = tmp_path / "job.out"
    job = _submit(slurm, env, 1, out, _ports()[1], "run.total_steps=100")
    run = tmp_path / "runs" / f"sao-aime-{job}"
    _wait(slurm, job, lambda i: bool(_rows(run / "metrics.jsonl")) or _done(i), 600, "the first step", out)
    subprocess.run(["scancel", job], env=slurm.env(), check=True, timeout=30)
    info = _wait(slurm, job, _done, 300, "the end of the cancelled job", out)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", f"{info}\n{_diagnose(slurm, out)}"
    rows = _rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(len(rows))) and len(rows) < 100, [r["step"] for r in rows]
    # the stop's own checkpoint, after the last logged step (save_every is 0: no periodic one)
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{len(rows):06d}", _diagnose(slurm, out)
    assert "checkpoint written" in next((run / "logs").glob("trainer-node0-*.log")).read_text()
    assert not (run / "final_model").exists()


def _server_pid(port: int) -> int:
    """The `vllm serve` process listening on ``port`` (its argv says --port PORT)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in argv and b"--port" in argv \
                and argv[argv.index(b"--port") + 1] == str(port).encode():
            return int(d.name)
    raise AssertionError(f"no vllm server with --port {port}")


def test_disaggregated_job_survives_a_server_kill_and_requeues_at_the_time_limit(slurm, model_dir, tmp_path):
    ports = _ports()
    rollout_port = int(ports[0].split("=")[1])
    env = _job_env(slurm, tmp_path / "runs", RECIPES / "disaggregated.yaml", model_dir, SAO_RESTART_BACKOFF_S="1")
    out = tmp_path / "job.out"
    total = 6  # steps after the warm-up (the first attempt stops after 1-4 of them)
    # rollout.timeout_s stays the recipe's: the batch wait does not count while no server is in service.
    job = _submit(slurm, env, 2, out, *ports, f"run.total_steps={total}", "rollout.server_deadline_s=900",
                  "rollout.start_min_servers=0", "rollout.weight_sync_check=true",
                  f"rollout.weight_sync_check_atol={CHECK_ATOL}")
    run = tmp_path / "runs" / f"sao-aime-{job}"
    metrics = run / "metrics.jsonl"
    killed = f"http://sao-n2:{rollout_port + 1}"
    frozen: list[int] = []  # process groups (each server's node starts it in its own: engine core too)

    def trainer_log() -> str:
        logs = list((run / "logs").glob("trainer-node0-*.log"))
        return logs[0].read_text() if logs else ""

    def freeze(port: int) -> None:
        pgid = os.getpgid(_server_pid(port))
        os.killpg(pgid, signal.SIGSTOP)
        frozen.append(pgid)

    try:
        # 1. Both servers in service (no episode ran before: start_min_servers=0). SIGKILL server 1,
        # freeze server 0 (a hung server; it also keeps the run from ending before the vLLM restart):
        # no server is in service and the run waits (rollout.server_deadline_s). The node restarts
        # server 1; it answers /health, gets the trainer's current weights at once and serves.
        _wait(slurm, job, lambda i: "in service (2 of 2)" in trainer_log() or _done(i), 600,
              "both servers in service", out)
        assert not _rows(metrics), "a step ran before both servers were in service"
        os.kill(_server_pid(rollout_port + 1), signal.SIGKILL)
        freeze(rollout_port)

        def served_again(info) -> bool:
            rows = _rows(metrics)
            return (bool(rows) and rows[-1]["rollout/server_revivals"] >= 1
                    and rows[-1]["rollout/episodes_by_server"][killed] > 0) or _done(info)
        _wait(slurm, job, served_again, 900, "the restarted server serving again", out)
        # 2. Freeze the restarted server too: the run waits for a server again, so the time-limit
        # signal lands before the last step whatever this machine's speed. Then thaw both.
        freeze(rollout_port + 1)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm.env(), check=True, timeout=30)
    finally:
        for pgid in frozen:
            os.killpg(pgid, signal.SIGCONT)
    info = _wait(slurm, job, lambda i: i.get("Restarts") == "1" or _done(i), 600, "the requeue", out)
    assert info.get("Restarts") == "1", f"{info}\n{_diagnose(slurm, out)}"
    attempt1 = _rows(metrics)
    stopped_at = len(attempt1)
    assert attempt1[-1]["step"] < total, "the first attempt ran every step: the signal came too late"
    revived = next(r for r in attempt1 if r["rollout/server_revivals"] >= 1)
    assert revived["rollout/server_deaths"] == 2 and revived["rollout/servers_alive"] == 1, revived
    # the current weights: the row's version is its batch's, before the step's own push (if any)
    assert revived["rollout/version_by_server"][killed] == revived["version"] + ("time/weight_sync_s" in revived), \
        revived
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{stopped_at:06d}", (latest, stopped_at)  # the stop's own checkpoint
    info = _wait(slurm, job, _done, 900, "the end of the requeued job", out)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", _diagnose(slurm, out)
    assert info["Restarts"] == "1"

    rows = _rows(metrics)
    warmup = 1  # the recipe's critic_warmup_steps
    assert [r["step"] for r in rows] == list(range(total + warmup)), [r["step"] for r in rows]  # each step once
    batches = _rows(run / "batches.jsonl")
    assert [b["step"] for b in batches] == list(range(total + warmup))
    trajs = [t for b in batches for t in b["traj_ids"]]
    prompts = [p for b in batches for p in b["prompt_ids"]]
    assert len(trajs) == len(set(trajs)) and len(prompts) == len(set(prompts))  # nothing trained twice
    # Every update that reached a server was checked there: its log-probs are the trainer's (both
    # servers at every update of the resumed attempt), the trainer scores lag-0 tokens as the servers
    # did, and no server had more than its --max-num-seqs (concurrency 8 over 2 servers) in flight.
    urls = set(rows[-1]["rollout/episodes_by_server"])
    checked = [r["weight_sync/logprob_diff_by_engine"] for r in rows if "weight_sync/logprob_diff_by_engine" in r]
    assert checked and all(d <= CHECK_ATOL for c in checked for d in c.values()), checked
    assert set(checked[-1]) == urls, checked[-1]
    lag0 = [r["logprob_mismatch_lag0"] for r in rows if "logprob_mismatch_lag0" in r]
    assert lag0 and max(lag0) < 1e-4, lag0
    assert all(0 < n <= 4 for n in rows[-1]["rollout/max_in_flight_by_server"].values()), rows[-1]
    log = out.read_text()
    assert "restart 1 of 3" in log and "restarted vllm-1" in log, log[-3000:]
    assert "stop requested: SIGTERM to the trainer" in log and f"requeueing job {job}" in log
    assert (run / "final_model" / "config.json").exists()
