"""The SLURM launch plan: roles, ranks, ports and commands, through Python and the sbatch dry run."""

import json
import os
import re
import subprocess
import sys

import pytest

from megatron_sao.cluster.launch_plan import LaunchPlanError, build_launch_plan, build_parser, render_bash
from tests.cluster.recipes import RECIPES
from tests.paths import REPO

AIME = str(RECIPES / "aime_disaggregated.yaml")
COLOC = str(RECIPES / "aime_colocated.yaml")


def dry_run(script: str, nodelist: str, *args: str, **env: str) -> str:
    """`bash slurm/<script> --dry-run` with fake SLURM variables and no srun/scontrol on PATH."""
    full = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "SAO_PYTHON": sys.executable,
            "SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "t",
            "SLURM_NNODES": str(len(nodelist.split(","))), "SAO_SKIP_PLAN": "1", "SAO_RUN_ROOT": "/scratch/runs", **env}
    res = subprocess.run(["bash", str(REPO / "slurm" / script), "--dry-run", *args], env=full, cwd="/",
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


def node_blocks(text: str) -> dict[str, list[str]]:
    """'[node 1 host role]' headers -> their command lines."""
    blocks, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"\[node (\d+) (\S+) (\w+)\]", line)
        if m:
            cur = f"{m.group(1)} {m.group(2)} {m.group(3)}"
            blocks[cur] = []
        elif cur and line.startswith("  "):
            blocks[cur].append(line.strip())
    return blocks


def test_one_node_colocated():
    out = dry_run("sao_aime.sh", "gpu17", SAO_CONFIG=COLOC, SAO_TRAINER_NODES="1")
    blocks = node_blocks(out)
    assert list(blocks) == ["0 gpu17 trainer"]
    (cmd,) = blocks["0 gpu17 trainer"]
    assert "torchrun --nnodes=1 --nproc-per-node=8 --node-rank=0 --master-addr=gpu17 --master-port=29500" in cmd
    assert "vllm serve" not in out and "rollout.server_urls" not in cmd
    assert "run.dir=/scratch/runs/t-4242" in cmd and "cluster.rollout_nodes=0" in cmd


def test_two_nodes_bracket_form_disaggregated():
    out = dry_run("sao_aime.sh", "node[01-02]", SAO_TRAINER_NODES="1", SAO_GPUS_PER_NODE="4",
                  SAO_HEALTH_TIMEOUT_S="900")
    blocks = node_blocks(out)
    assert list(blocks) == ["0 node01 trainer", "1 node02 rollout"]
    trainer = blocks["0 node01 trainer"]
    # Started at once, not after the servers' /health: the trainer waits for them itself.
    (cmd,) = trainer
    assert "--nnodes=1 --nproc-per-node=4 --node-rank=0 --master-addr=node01" in cmd
    assert """'rollout.server_urls=["http://node02:8000"]'""" in cmd  # tp=4 on 4 GPUs: one server
    assert "rollout.backend=vllm_server" in cmd
    assert "rollout.server_start_timeout_s=900" in cmd  # the trainer's deadline for the servers' /health
    (vllm,) = [line for line in blocks["1 node02 rollout"] if "vllm serve" in line]
    assert "VLLM_SERVER_DEV_MODE=1" in vllm and "CUDA_VISIBLE_DEVICES=0,1,2,3" in vllm
    assert "--tensor-parallel-size 4" in vllm and "--port 8000" in vllm
    assert "--logprobs-mode processed_logprobs" in vllm and "--generation-config vllm" in vllm
    assert """--weight-transfer-config '{"backend":"nccl"}'""" in vllm
    assert "torchrun" not in " ".join(blocks["1 node02 rollout"])


def test_four_nodes_mixed_hostlist_coding():
    out = dry_run("sao_coding.sh", "gpu[1-2],cpu[07-08]", "run.total_steps=3", SAO_TRAINER_NODES="2",
                  SAO_MODEL_DIR="/ckpt/qwen")
    blocks = node_blocks(out)
    assert list(blocks) == ["0 gpu1 trainer", "1 gpu2 trainer", "2 cpu07 rollout", "3 cpu08 rollout"]
    urls = [f"http://{h}:{p}" for h in ("cpu07", "cpu08") for p in (8000, 8001)]
    for rank, host in ((0, "gpu1"), (1, "gpu2")):
        (cmd,) = blocks[f"{rank} {host} trainer"]
        assert f"--nnodes=2 --nproc-per-node=8 --node-rank={rank} --master-addr=gpu1 --master-port=29500" in cmd
        assert "coding_disaggregated.yaml" in cmd and "run.total_steps=3" in cmd and "model.path=/ckpt/qwen" in cmd
        assert "rollout.server_urls=" + json.dumps(urls) in cmd.replace("'", "")
    for host in ("cpu07", "cpu08"):
        serves = [x for x in blocks[f"{['cpu07', 'cpu08'].index(host) + 2} {host} rollout"] if "vllm serve" in x]
        assert len(serves) == 2
        assert "vllm serve /ckpt/qwen" in serves[0] and "--port 8000" in serves[0] and "--port 8001" in serves[1]
        assert "CUDA_VISIBLE_DEVICES=4,5,6,7" in serves[1]
        assert "--max-num-seqs 32" in serves[0]  # rollout.max_num_seqs of the recipe


@pytest.mark.slow
def test_dry_run_runs_the_preflight_plan_and_refuses():
    env = {"PATH": "/usr/bin:/bin", "SAO_PYTHON": sys.executable, "SLURM_JOB_NODELIST": "n[1-4]",
           "SLURM_JOB_ID": "1", "SAO_TRAINER_NODES": "2"}
    res = subprocess.run(["bash", str(REPO / "slurm" / "sao_aime.sh"), "--dry-run", "parallel.ep=16"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "refused: cluster.trainer_nodes" in res.stderr and "vllm serve" not in res.stdout


def test_plan_errors_name_the_fix():
    with pytest.raises(LaunchPlanError, match="leaves none for vLLM"):
        build_launch_plan(AIME, ["a", "b"], run_dir="/r", trainer_nodes=2)
    with pytest.raises(LaunchPlanError, match="cluster.trainer_nodes=4; they must match"):
        build_launch_plan(COLOC, ["a", "b"], run_dir="/r")
    with pytest.raises(LaunchPlanError, match="rollout_tp=4 must divide the 2 GPUs"):
        build_launch_plan(AIME, ["a", "b"], run_dir="/r", trainer_nodes=1, gpus_per_node=2)
    with pytest.raises(LaunchPlanError, match="outside the allocation"):
        build_launch_plan(AIME, ["a", "b"], run_dir="/r", trainer_nodes=1).node(5)


def test_trainer_nodes_all_follows_the_allocation():
    """SAO_TRAINER_NODES=all: a colocated job requeued on fewer nodes trains on all of them (its checkpoint
    reshards to the new data-parallel size, docs/cluster.md); the CLI takes a count or "all"."""
    for hosts in (["a", "b", "c", "d"], ["a", "b"]):
        plan = build_launch_plan(COLOC, hosts, run_dir="/r", trainer_nodes="all")
        assert plan.trainer_nodes == len(hosts) and plan.rollout_nodes == 0
        assert f"cluster.trainer_nodes={len(hosts)}" in plan.trainer_overrides
    with pytest.raises(LaunchPlanError, match="leaves none for vLLM"):
        build_launch_plan(AIME, ["a", "b"], run_dir="/r", trainer_nodes="all")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--config", COLOC, "--nodelist", "a", "--run-dir", "/r", "--trainer-nodes", "most"])


def test_bash_rendering_round_trips_through_eval():
    """Quoting: what common.sh evals must give back argv exactly (JSON, spaces, quotes)."""
    plan = build_launch_plan(AIME, ["t0", "r0"], run_dir="/r w/x", trainer_nodes=1,
                             overrides=["run.name=it's a test"])
    for rank in (0, 1):
        script = render_bash(plan, rank) + '\nprintf "%s\\n" "${SAO_PROC_CMD_0[@]}"; echo "$SAO_ROLE|$SAO_DONE_FILE"'
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
        lines = out.splitlines()
        proc = plan.nodes[rank].processes[0]
        assert lines[:-1] == ["env", *(f"{k}={v}" for k, v in proc.env.items()), *proc.argv]
        assert lines[-1] == f"{plan.nodes[rank].role}|/r w/x/.trainer-done-local-0"


@pytest.mark.slow
def test_convert_uses_the_recipe_layout():
    env = {"PATH": "/usr/bin:/bin", "SAO_PYTHON": sys.executable, "SAO_MODEL_DIR": "/hf", "SAO_MEGATRON_CKPT": "/mg",
           "SAO_HF_OUT": "/out"}
    run = lambda *a: subprocess.run(["bash", str(REPO / "slurm" / "convert.sh"), "--dry-run", *a], env=env,  # noqa: E731
                                    capture_output=True, text=True, timeout=60)
    res = run("hf-to-megatron", "parallel.ep=16")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[1:] == ["tools/convert_hf_to_megatron.py", "--hf-dir", "/hf", "--out-dir", "/mg",
                                      "--tp", "4", "--pp", "1", "--ep", "16", "--etp", "1"]
    res = run("megatron-to-hf")
    assert res.stdout.split()[1:] == ["tools/convert_megatron_to_hf.py", "--megatron-dir", "/mg", "--out-dir", "/out"]
    assert run("sideways").returncode == 2


@pytest.mark.parametrize("env, expected", [
    ({"NCCL_SOCKET_IFNAME": "ib0"}, "GLOO_SOCKET_IFNAME=ib0"),
    ({"NCCL_SOCKET_IFNAME": "=bond0,eth1"}, "GLOO_SOCKET_IFNAME=bond0,eth1"),
    ({"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "eth2"}, "GLOO_SOCKET_IFNAME=eth2"),
    ({}, None),  # common.sh's default ^lo,docker names no interface: each trainer picks the route to the master
])
def test_trainers_get_gloo_socket_ifname_beside_nccl(env, expected):
    out = dry_run("sao_aime.sh", "gpu[1-2]", SAO_CONFIG=COLOC, SAO_TRAINER_NODES="2", **env)
    trainers = [line for block, lines in node_blocks(out).items() if block.endswith("trainer") for line in lines
                if "torchrun" in line]
    assert len(trainers) == 2
    for line in trainers:
        if expected is None:
            assert "GLOO_SOCKET_IFNAME" not in line
        else:
            assert line.startswith("env ") and expected in line.split(" torchrun ")[0], line


def test_gloo_interface_rules():
    from megatron_sao.distributed.socket_ifname import gloo_ifname_from_env, interface_for

    assert gloo_ifname_from_env({"NCCL_SOCKET_IFNAME": "^lo,docker"}) is None
    assert gloo_ifname_from_env({"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "ib0"}) == "eth0"
    assert gloo_ifname_from_env({"NCCL_SOCKET_IFNAME": " =ib0 , ib1 "}) == "ib0,ib1"
    assert interface_for("127.0.0.1") == "lo"  # the kernel's route, read back as an interface name
    assert interface_for("no-such-host.invalid") is None


def test_the_plan_and_the_trainer_agree_on_transfer_ports_and_the_per_server_cap():
    """The trainer's view (its config after the plan's overrides) and each vllm serve command agree:
    one rendezvous port per server on the first trainer host (weight_sync_port + i: the ports the one
    transfer group over every server is formed on in turn, weights/server_group.py), each
    server's own rendezvous rule as vLLM computes it (rank offset 1, world 1 + rollout_tp), and its
    --max-num-seqs is the trainer's per-server cap."""
    from pathlib import Path

    from megatron_sao.cluster.layout import max_num_seqs
    from megatron_sao.config import load_config
    from megatron_sao.trainer.components import engine_config
    from megatron_sao.weights.vllm_worker.transfer_group import Rendezvous

    hosts = ["t0", "t1", "r0", "r1"]
    plan = build_launch_plan(AIME, hosts, run_dir="/r", trainer_nodes=2, gpus_per_node=8)
    assert plan.server_urls == [f"http://{h}:{8000 + i}" for h in ("r0", "r1") for i in range(2)]  # TP=4: 2 per node
    cfg = load_config(AIME, plan.trainer_overrides)
    ec = engine_config(cfg, Path("/m"))
    assert ec.server_urls == tuple(plan.server_urls) and ec.tensor_parallel_size == 4
    assert ec.weight_transfer_master_address == "t0" and list(ec.weight_transfer_ports) == [29600, 29601, 29602, 29603]
    for i in range(4):
        rv = Rendezvous(ec.weight_transfer_master_address, ec.transfer_port(i), ec.tensor_parallel_size)
        assert rv.worker_init_info() == {"master_address": "t0", "master_port": 29600 + i, "rank_offset": 1,
                                         "world_size": 5, "packed": False}
    assert max_num_seqs(cfg, len(cfg.rollout.server_urls)) == 32  # the recipe's rollout.max_num_seqs
    serves = [p.argv for n in plan.nodes if n.role == "rollout" for p in n.processes]
    assert all(a[a.index("--max-num-seqs") + 1] == "32" and "--enable-scale-out" in a for a in serves)
    derived = load_config(AIME, [*(o for o in plan.trainer_overrides if not o.startswith("rollout.max_num_seqs")),
                                 "rollout.max_num_seqs=null"])
    # without it: an even share of concurrency 256 over 4 servers
    assert max_num_seqs(derived, len(derived.rollout.server_urls)) == 64
    assert all(a[a.index("--weight-transfer-config") + 1] == '{"backend":"nccl"}' for a in serves)
    assert all("--worker-extension-cls" not in a for a in serves)  # GPU build: vLLM's own NCCL engine
    assert all("SAO_WEIGHT_SYNC_PORT" not in p.env for n in plan.nodes for p in n.processes)


def test_plan_refuses_transfer_ports_on_the_torchrun_port_and_reload_with_vllm():
    with pytest.raises(LaunchPlanError, match="collide with cluster.master_port=29500"):
        build_launch_plan(AIME, ["t0", "r0"], run_dir="/r", trainer_nodes=1,
                          overrides=["cluster.weight_sync_port=29500"])
    with pytest.raises(LaunchPlanError, match="reload works with rollout/engines/http_server.py only"):
        build_launch_plan(AIME, ["t0", "r0"], run_dir="/r", trainer_nodes=1,
                          overrides=["rollout.weight_transport=reload"])
    plan = build_launch_plan(AIME, ["t0", "r0"], run_dir="/r", trainer_nodes=1, overrides=["rollout.max_num_seqs=12"])
    (serve, _) = [p.argv for p in plan.nodes[1].processes]
    assert serve[serve.index("--max-num-seqs") + 1] == "12" and "rollout.max_num_seqs=12" in plan.trainer_overrides


def test_vllm_serves_the_model_under_the_name_the_trainer_asks_for(tmp_path):
    """A trailing / in SAO_MODEL_DIR: vLLM serves the name as given and the trainer asks for
    str(Path(model.path)), so the plan hands vllm serve the normalized path (else every request 404s)."""
    from pathlib import Path

    from megatron_sao.config import load_config
    from megatron_sao.trainer.components import engine_config

    model = f"{tmp_path}/hf/"
    plan = build_launch_plan(AIME, ["t0", "r0"], run_dir="/r", trainer_nodes=1, gpus_per_node=4, model_dir=model,
                             overrides=[f"model.path={model}"])
    (serve,) = [p.argv for n in plan.nodes if n.role == "rollout" for p in n.processes]
    asked = engine_config(load_config(AIME, [f"model.path={model}", *plan.trainer_overrides]), Path(model)).model_path
    assert serve[serve.index("serve") + 1] == asked == f"{tmp_path}/hf"
