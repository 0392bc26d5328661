"""slurm/common.sh's per-node logic and the Python supervisor, with fake `vllm` and `torchrun`.

Two "nodes" (127.0.0.1 and localhost) run the same task srun would start. The fake vLLM answers
/health and leaves a grandchild behind, so the tests can check that a stop reaches the whole
process group; the fake torchrun records its argv and exits with a chosen code.
"""

import os
import socket
import stat
import subprocess
import sys
import textwrap

from conftest import RECIPES, REPO
from megatron_sao.cluster.launch_local import build_local_plan
from megatron_sao.cluster.supervisor import Supervisor, SupervisorError

FAKE_VLLM = textwrap.dedent(f"""\
    #!{sys.executable}
    import http.server, os, subprocess, sys
    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    out = os.environ["FAKE_OUT"]
    child = subprocess.Popen(["sleep", "300"])  # a worker that must die with its group
    open(os.path.join(out, f"vllm-{{port}}.pids"), "w").write(f"{{os.getpid()}} {{child.pid}}")
    if os.environ.get("FAKE_VLLM_FAIL"):
        sys.exit(1)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("0.0.0.0", port), H).serve_forever()
    """)
FAKE_TORCHRUN = textwrap.dedent("""\
    #!/bin/bash
    printf '%s\\n' "$@" > "$FAKE_OUT/torchrun.args"
    exit "${FAKE_TRAINER_RC:-0}"
    """)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
            "SLURM_JOB_ID": "7", "SAO_TRAINER_NODES": "1", "SAO_GPUS_PER_NODE": "4", "SAO_RUN_DIR": str(tmp_path / "run"),
            "SAO_POLL_S": "0.2", "SAO_KILL_GRACE_S": "5", "SAO_HEALTH_TIMEOUT_S": "60",
            "SAO_OVERRIDES_STR": f"cluster.rollout_port={port}", "FAKE_OUT": str(tmp_path),
            "SAO_VLLM": _exe(tmp_path / "vllm", FAKE_VLLM), "SAO_TORCHRUN": _exe(tmp_path / "torchrun", FAKE_TORCHRUN),
            **extra}


def _node(env, rank):
    return subprocess.Popen(["bash", str(REPO / "slurm" / "common.sh"), "node"], env={**env, "SLURM_NODEID": str(rank)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_trainer_waits_for_health_then_rollout_node_stops_cleanly(tmp_path):
    port = _free_port()
    env = _env(tmp_path, port, FAKE_TRAINER_RC="3")
    rollout = _node(env, 1)
    trainer = _node(env, 0)
    t_out, _ = trainer.communicate(timeout=90)
    r_out, _ = rollout.communicate(timeout=60)
    assert trainer.returncode == 3, t_out  # the trainer's exit code is the node's
    assert rollout.returncode == 0, r_out  # done file seen: an intended stop, not a crash
    assert f"healthy: http://localhost:{port}/health" in t_out
    args = (tmp_path / "torchrun.args").read_text().splitlines()
    assert args[:4] == ["--nnodes=1", "--nproc-per-node=4", "--node-rank=0", "--master-addr=127.0.0.1"]
    assert f'rollout.server_urls=["http://localhost:{port}"]' in args
    server, worker = map(int, (tmp_path / f"vllm-{port}.pids").read_text().split())
    assert not _alive(server) and not _alive(worker)  # the whole process group was stopped
    logs = sorted(p.name for p in (tmp_path / "run" / "logs").iterdir())
    assert logs == ["rollout-node0-localhost-0.log", "trainer-node0-127.0.0.1.log"]


def test_rollout_node_fails_when_its_server_dies(tmp_path):
    port = _free_port()
    rollout = _node(_env(tmp_path, port, FAKE_VLLM_FAIL="1"), 1)
    out, _ = rollout.communicate(timeout=60)
    assert rollout.returncode == 1
    assert "exited before the trainer finished" in out
    _, worker = map(int, (tmp_path / f"vllm-{port}.pids").read_text().split())
    assert not _alive(worker)


def test_supervisor_health_deadline_and_early_death(tmp_path):
    with Supervisor(grace_s=2, poll_s=0.05) as sup:
        sup.start("dies", [sys.executable, "-c", "import sys; sys.exit(4)"], str(tmp_path / "d.log"))
        try:
            sup.wait_healthy([f"http://127.0.0.1:{_free_port()}/health"], timeout_s=30)
        except SupervisorError as e:
            assert "dies exited with code 4" in str(e)
        else:
            raise AssertionError("expected SupervisorError")
    with Supervisor(grace_s=2, poll_s=0.05) as sup:
        sup.start("sleeper", ["sleep", "30"], str(tmp_path / "s.log"))
        try:
            sup.wait_healthy([f"http://127.0.0.1:{_free_port()}/health"], timeout_s=0.3)
        except SupervisorError as e:
            assert "no /health answer after 0.3s" in str(e)
        else:
            raise AssertionError("expected SupervisorError")
        pid = sup.procs[0].popen.pid
    assert sup.procs[0].popen.returncode is not None and not _alive(pid)


def test_local_plan_shape(tmp_path):
    cfg = str(RECIPES / "online_style.yaml")
    plan = build_local_plan(cfg, trainer_ranks=2, rollout_servers=2, run_dir=str(tmp_path), ports=[9101, 9102],
                            master_port=29700, overrides=["run.total_steps=2"], python="py")
    assert [s.argv[:5] for s in plan.servers] == [["py", "-m", "megatron_sao.cli", "serve-rollout", cfg]] * 2
    assert plan.servers[1].argv[5:] == ["--host", "127.0.0.1", "--port", "9102", "run.total_steps=2",
                                        f"run.dir={tmp_path}"]  # the server materializes models in the run dir
    assert plan.health == ["http://127.0.0.1:9101/health", "http://127.0.0.1:9102/health"]
    t = plan.trainer.argv
    assert t[:7] == ["py", "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
                     "--master-addr=127.0.0.1", "--master-port=29700"]
    assert t[7:11] == ["-m", "megatron_sao.cli", "train", cfg]
    assert 'rollout.server_urls=["http://127.0.0.1:9101", "http://127.0.0.1:9102"]' in t
    assert "rollout.backend=vllm_server" in t and f"run.dir={tmp_path}" in t
    assert plan.trainer.env["OMP_NUM_THREADS"] == "1"
    embedded = build_local_plan(cfg, trainer_ranks=1, rollout_servers=0, run_dir=str(tmp_path))
    assert embedded.servers == [] and not any("server_urls" in a for a in embedded.trainer.argv)


def test_local_plan_refuses_bad_input(tmp_path):
    import pytest

    from megatron_sao.config import ConfigError

    cfg = str(RECIPES / "online_style.yaml")
    with pytest.raises(ValueError, match="--trainer-ranks must be >= 1"):
        build_local_plan(cfg, trainer_ranks=0, rollout_servers=1, run_dir=str(tmp_path))
    with pytest.raises(ValueError, match="2 ports for 1 rollout servers"):
        build_local_plan(cfg, trainer_ranks=1, rollout_servers=1, run_dir=str(tmp_path), ports=[1, 2])
    with pytest.raises(ConfigError, match="run.total_stepz"):
        build_local_plan(cfg, trainer_ranks=1, rollout_servers=1, run_dir=str(tmp_path), overrides=["run.total_stepz=1"])
