"""slurm/common.sh's per-node logic and the Python supervisor, with fake `vllm` and `torchrun`.

Two "nodes" (127.0.0.1 and localhost) run the same task srun would start. The fake vLLM answers
/health and leaves a grandchild behind, so the tests can check that a stop reaches the whole
process group; the fake torchrun records its argv and exits with a chosen code.
"""

import os
import stat
import subprocess
import sys
import textwrap
import time

from megatron_sao.cluster.launch_local import build_local_plan
from megatron_sao.cluster.supervisor import RestartPolicy, Supervisor, SupervisorError
from megatron_sao.distributed.ports import free_port
from tests.cluster.recipes import RECIPES
from tests.paths import REPO

FAKE_VLLM = textwrap.dedent(f"""\
    #!{sys.executable}
    import http.server, os, subprocess, sys, time
    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    out = os.environ["FAKE_OUT"]
    child = subprocess.Popen(["sleep", "300"])  # a worker that must die with its group
    starts = os.path.join(out, f"vllm-{{port}}.pids")
    first = not os.path.exists(starts)
    with open(starts, "a") as f:  # one line per start: pid, worker pid, time
        f.write(f"{{os.getpid()}} {{child.pid}} {{time.time()}}\\n")
    if os.environ.get("FAKE_VLLM_FAIL") or (first and os.environ.get("FAKE_VLLM_FAIL_FIRST")):
        sys.exit(1)
    time.sleep(float(os.environ.get("FAKE_VLLM_LOAD_S", "0")))  # loading the model: no /health yet
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("0.0.0.0", port), H).serve_forever()
    """)
FAKE_TORCHRUN = textwrap.dedent("""\
    #!/bin/bash
    printf '%s\\n' "$@" > "$FAKE_OUT/torchrun.args"
    if [[ -n "${FAKE_TRAINER_HEALTH:-}" ]]; then  # the trainer waits for the server itself
        until "$SAO_PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1)' \
            "$FAKE_TRAINER_HEALTH" 2>/dev/null; do echo waiting >> "$FAKE_OUT/torchrun.waits"; sleep 0.2; done
    fi
    if [[ -n "${FAKE_TRAINER_WAIT:-}" ]]; then  # run until SIGTERM, like the trainer's checkpoint-and-exit
        trap 'echo TERM >> "$FAKE_OUT/torchrun.signals"; exit 130' TERM
        sleep 300 & wait
    fi
    exit "${FAKE_TRAINER_RC:-0}"
    """)


def _exe(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def _env(tmp_path, port, **extra):
    return {"PATH": os.environ["PATH"], "SAO_PYTHON": sys.executable, "SAO_REPO": str(REPO),
            "SAO_CONFIG": str(RECIPES / "aime_disaggregated.yaml"), "SLURM_JOB_NODELIST": "127.0.0.1,localhost",
            "SLURM_JOB_ID": "7", "SAO_TRAINER_NODES": "1", "SAO_GPUS_PER_NODE": "4",
            "SAO_RUN_DIR": str(tmp_path / "run"), "SAO_POLL_S": "0.2", "SAO_KILL_GRACE_S": "5",
            "SAO_HEALTH_TIMEOUT_S": "60",
            "SAO_OVERRIDES_STR": f"cluster.rollout_port={port}", "FAKE_OUT": str(tmp_path),
            "SAO_VLLM": _exe(tmp_path / "vllm", FAKE_VLLM), "SAO_TORCHRUN": _exe(tmp_path / "torchrun", FAKE_TORCHRUN),
            **extra}


def _node(env, rank):
    return subprocess.Popen(["bash", str(REPO / "slurm" / "common.sh"), "node"], env={**env, "SLURM_NODEID": str(rank)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_trainer_starts_while_the_server_loads_then_rollout_node_stops_cleanly(tmp_path):
    """The trainer node starts torchrun at once, not after the servers' /health (the trainer waits for
    them itself, rollout/episode_driver.py): the fake trainer polls the server, which takes 3 s to load."""
    port = free_port()
    env = _env(tmp_path, port, FAKE_TRAINER_RC="3", FAKE_VLLM_LOAD_S="3",
               FAKE_TRAINER_HEALTH=f"http://localhost:{port}/health")
    rollout = _node(env, 1)
    trainer = _node(env, 0)
    t_out, _ = trainer.communicate(timeout=90)
    r_out, _ = rollout.communicate(timeout=60)
    assert trainer.returncode == 3, t_out  # the trainer's exit code is the node's
    assert rollout.returncode == 0, r_out  # done file seen: an intended stop, not a crash
    assert (tmp_path / "torchrun.waits").exists()  # it was running before the server answered
    args = (tmp_path / "torchrun.args").read_text().splitlines()
    assert args[:4] == ["--nnodes=1", "--nproc-per-node=4", "--node-rank=0", "--master-addr=127.0.0.1"]
    assert f'rollout.server_urls=["http://localhost:{port}"]' in args
    ((server, worker, _),) = _starts(tmp_path, port)
    server, worker = int(server), int(worker)
    assert not _alive(server) and not _alive(worker)  # the whole process group was stopped
    logs = sorted(p.name for p in (tmp_path / "run" / "logs").iterdir())
    assert logs == ["rollout-node0-localhost-0.log", "trainer-node0-127.0.0.1.log"]


def _starts(tmp_path, port):
    return [line.split() for line in (tmp_path / f"vllm-{port}.pids").read_text().splitlines()]


def test_rollout_node_restarts_a_dead_server_with_backoff_a_bounded_number_of_times(tmp_path):
    """A server that keeps exiting is restarted SAO_SERVER_RESTARTS times, each after a longer wait, each
    logged; then it stays down and the node waits for the trainer (exit 0: no srun --kill-on-bad-exit)."""
    port = free_port()
    env = _env(tmp_path, port, FAKE_VLLM_FAIL="1", SAO_SERVER_RESTARTS="2", SAO_RESTART_BACKOFF_S="1")
    log = tmp_path / "node.out"
    with open(log, "w") as out:
        rollout = subprocess.Popen(["bash", str(REPO / "slurm" / "common.sh"), "node"], stdout=out,
                                   stderr=subprocess.STDOUT, env={**env, "SLURM_NODEID": "1"})
        try:
            deadline = time.monotonic() + 60
            while "no restart left" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert rollout.poll() is None, log.read_text()  # still up: the trainer decides the run's end
            (tmp_path / "run" / ".trainer-done-7-0").touch()
            assert rollout.wait(30) == 0
        finally:
            rollout.kill()
    text = log.read_text()
    assert "vllm-0 exited with 1 before the trainer finished; restart 1 of 2 in 1s" in text, text
    assert "restart 2 of 2 in 2s" in text and "restarted vllm-0 (restart 2 of 2" in text
    assert "vllm-0 exited with 1; no restart left (SAO_SERVER_RESTARTS=2" in text
    starts = _starts(tmp_path, port)
    assert len(starts) == 3  # the first start and two restarts
    gaps = [float(b[2]) - float(a[2]) for a, b in zip(starts, starts[1:])]
    assert gaps[0] >= 1 and gaps[1] >= 2, gaps  # the backoff doubles
    assert not any(_alive(int(w)) for _, w, _ in starts)  # each dead server's workers were stopped


def test_a_restarted_server_serves_again_and_stops_with_the_node(tmp_path):
    from megatron_sao.cluster.supervisor import http_ok

    port = free_port()
    rollout = _node(_env(tmp_path, port, FAKE_VLLM_FAIL_FIRST="1", SAO_RESTART_BACKOFF_S="0"), 1)
    try:
        deadline = time.monotonic() + 60
        while not http_ok(f"http://127.0.0.1:{port}/health") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert http_ok(f"http://127.0.0.1:{port}/health")  # the restarted server answers
        (tmp_path / "run" / ".trainer-done-7-0").touch()
        out, _ = rollout.communicate(timeout=60)
    finally:
        rollout.kill()
    assert rollout.returncode == 0 and "restarted vllm-0 (restart 1 of 3" in out, out
    (_, w1, _), (s2, w2, _) = _starts(tmp_path, port)
    assert not _alive(int(w1)) and not _alive(int(s2)) and not _alive(int(w2))


def test_trainer_node_sigterms_the_trainer_on_the_stop_file_and_exits_0(tmp_path):
    """The batch host's stop request (USR1 before the time limit) reaches the trainer as one SIGTERM, not
    srun's SIGKILL; the node exits 0 so that srun does not kill the other nodes, and writes the done file."""
    port = free_port()
    env = _env(tmp_path, port, FAKE_TRAINER_WAIT="1")
    rollout = _node(env, 1)
    trainer = _node(env, 0)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "torchrun.args").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        (tmp_path / "run" / ".stop-7-0").touch()
        t_out, _ = trainer.communicate(timeout=60)
        r_out, _ = rollout.communicate(timeout=60)
    finally:
        trainer.kill()
        rollout.kill()
    assert trainer.returncode == 0, t_out
    assert "stop requested: SIGTERM to the trainer" in t_out and "trainer stopped on request (exit 130)" in t_out
    assert (tmp_path / "torchrun.signals").read_text() == "TERM\n"  # once
    assert rollout.returncode == 0, r_out


def test_supervisor_health_deadline_and_early_death(tmp_path):
    with Supervisor(grace_s=2, poll_s=0.05) as sup:
        sup.start("dies", [sys.executable, "-c", "import sys; sys.exit(4)"], str(tmp_path / "d.log"))
        try:
            sup.wait_healthy([f"http://127.0.0.1:{free_port()}/health"], timeout_s=30)
        except SupervisorError as e:
            assert "dies exited with code 4" in str(e)
        else:
            raise AssertionError("expected SupervisorError")
    with Supervisor(grace_s=2, poll_s=0.05) as sup:
        sup.start("sleeper", ["sleep", "30"], str(tmp_path / "s.log"))
        try:
            sup.wait_healthy([f"http://127.0.0.1:{free_port()}/health"], timeout_s=0.3)
        except SupervisorError as e:
            assert "no /health answer after 0.3s" in str(e)
        else:
            raise AssertionError("expected SupervisorError")
        pid = sup.procs[0].popen.pid
    assert sup.procs[0].popen.returncode is not None and not _alive(pid)


def test_restart_policy_and_the_python_supervisor_restart(tmp_path):
    """launch_local's twin of the node's restarts: bounded, doubling, capped; a restart reruns the same
    argv into the same log, a forgotten process is no longer waited for."""
    p = RestartPolicy(max_restarts=4, backoff_s=1.0, max_backoff_s=5.0)
    assert [p.delay(n) for n in (1, 2, 3, 4, 5)] == [1.0, 2.0, 4.0, 5.0, None]
    marks = tmp_path / "starts"
    argv = [sys.executable, "-c", f"open({str(marks)!r}, 'a').write('x'); raise SystemExit(5)"]
    with Supervisor(grace_s=2, poll_s=0.05) as sup:
        sup.start("srv", argv, str(tmp_path / "srv.log"))
        sup.start("trainer", ["sleep", "30"], str(tmp_path / "t.log"))
        assert sup.wait_any(timeout_s=30) == ("srv", 5)
        sup.restart("srv")
        assert sup.wait_any(timeout_s=30) == ("srv", 5)
        sup.forget("srv")
        assert [q.name for q in sup.procs] == ["trainer"]
        try:
            sup.wait_any(timeout_s=0.3)
        except SupervisorError:
            pass  # only the trainer is watched, and it is still running
        else:
            raise AssertionError("a forgotten process was waited for")
    assert marks.read_text() == "xx"


def test_local_plan_is_the_slurm_plan_on_localhost(tmp_path):
    """launch_local runs build_launch_plan's processes (the code slurm/sao_aime.sh runs), with this
    machine's free ports and the CPU build's executables."""
    cfg = str(RECIPES / "online_style.yaml")
    plan = build_local_plan(cfg, trainer_ranks=2, rollout_servers=2, run_dir=str(tmp_path), rollout_port=9101,
                            master_port=29700, weight_sync_port=29801, overrides=["run.total_steps=2"], python="py",
                            server="vllm")
    s0, s1 = (s.argv for s in plan.servers)
    assert s0[:5] == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "Qwen/Qwen3-30B-A3B-Instruct-2507"]
    assert s1[s1.index("--port") + 1] == "9102" and "--enable-scale-out" in s1
    assert s1[s1.index("--weight-transfer-config") + 1] == '{"backend":"sao_gloo"}'
    assert s1[s1.index("--worker-extension-cls") + 1] == "megatron_sao.weights.vllm_worker.extension.SAOWorkerExtension"
    assert s1[s1.index("--max-num-seqs") + 1] == "64"  # online_style: rollout.max_num_seqs
    assert [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in plan.servers] == ["0", str(1 % (os.cpu_count() or 1))]
    assert plan.health == ["http://127.0.0.1:9101/health", "http://127.0.0.1:9102/health"]
    t = plan.trainer.argv
    assert t[:8] == ["py", "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--node-rank=0",
                     "--master-addr=127.0.0.1", "--master-port=29700"]
    assert t[8:12] == ["-m", "megatron_sao.cli", "train", str(RECIPES / "online_style.yaml")]
    assert 'rollout.server_urls=["http://127.0.0.1:9101", "http://127.0.0.1:9102"]' in t
    assert ("rollout.weight_transfer_ports=[29801, 29802]" in t
            and "rollout.weight_transfer_master_address=127.0.0.1" in t)
    assert "rollout.max_num_seqs=64" in t and "rollout.weight_transport=gloo" in t
    assert "rollout.backend=vllm_server" in t and f"run.dir={tmp_path}" in t
    assert plan.trainer.env["OMP_NUM_THREADS"] == "1"
    sao = build_local_plan(cfg, trainer_ranks=1, rollout_servers=1, run_dir=str(tmp_path), python="py")
    (srv,) = sao.servers
    assert srv.argv[:5] == ["py", "-m", "megatron_sao.cli", "serve-rollout", cfg]
    assert f"run.dir={tmp_path}" in srv.argv  # the server materializes models in the run dir
    embedded = build_local_plan(cfg, trainer_ranks=1, rollout_servers=0, run_dir=str(tmp_path))
    assert embedded.servers == [] and not any("server_urls" in a for a in embedded.trainer.argv)
    assert "rollout.weight_transport=auto" in embedded.trainer.argv  # the recipe's nccl is for its servers


def test_local_plan_refuses_bad_input(tmp_path):
    import pytest

    from megatron_sao.config import ConfigError

    cfg = str(RECIPES / "online_style.yaml")
    with pytest.raises(ValueError, match="--trainer-ranks must be >= 1"):
        build_local_plan(cfg, trainer_ranks=0, rollout_servers=1, run_dir=str(tmp_path))
    with pytest.raises(ValueError, match="--server must be vllm or sao"):
        build_local_plan(cfg, trainer_ranks=1, rollout_servers=1, run_dir=str(tmp_path), server="sglang")
    with pytest.raises(ConfigError, match="run.total_stepz"):
        build_local_plan(cfg, trainer_ranks=1, rollout_servers=1, run_dir=str(tmp_path),
                         overrides=["run.total_stepz=1"])
