"""Who runs what where: roles, ranks, addresses, ports and commands of a multi-node SAO job.

The sbatch scripts stay thin by asking this module for everything that needs arithmetic:

    python -m megatron_sao.cluster.launch_plan --config C --nodelist "node[01-04]" \
        --node-rank 2 --format bash  [key=value ...]

`--format bash` prints shell assignments for one node (eval'd by slurm/common.sh), `text` prints
every node's commands (the dry run), `json` the whole plan.

Layout of an allocation of N nodes: the first `T` hosts (T = cluster.trainer_nodes, or
--trainer-nodes) are trainer nodes running one `torchrun` each (static rendezvous on the first
trainer host); in disaggregated placement the remaining N - T hosts are rollout nodes running
gpus_per_node / rollout_tp `vllm serve` processes each, on consecutive ports from
cluster.rollout_port, and the trainer gets `rollout.backend=vllm_server` plus their URLs. The
allocation is the truth for node counts: the plan passes the resulting cluster.* values to the
trainer as overrides so that the trainer's config describes the job it is actually in.

Every server is used (rollout/rollout_side.py), so the plan also fixes what both sides must agree on:
`--max-num-seqs` of each server = the trainer's per-server request cap (`rollout.max_num_seqs`, default
an even share of rollout.concurrency), and server i's weight-transfer group meets on the first trainer
host at port `cluster.weight_sync_port + i` (`rollout.weight_transfer_master_address` /
`rollout.weight_transfer_ports`), with a world of 1 + rollout_tp. `vllm serve` runs with
`--enable-scale-out` (the token-in/token-out route whose answers carry per-token weight versions)
and the weight-transfer backend of `rollout.weight_transport` (`nccl`; `gloo` on CPU builds).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import PurePosixPath
from typing import Literal, Mapping, Sequence

from megatron_sao.cluster.hostlist import HostlistError, expand_hostlist
from megatron_sao.config import ConfigError, SAOConfig, load_config
from megatron_sao.distributed.socket_ifname import GLOO, gloo_ifname_from_env
from megatron_sao.weights.vllm_worker import WORKER_EXTENSION

Role = Literal["trainer", "rollout"]


class LaunchPlanError(ValueError):
    """The allocation cannot host the configured job; the message names the field or variable."""


@dataclass(frozen=True)
class ProcessSpec:
    """One long-running process of a node: argv, extra environment, and its own log file."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: str

    def shell(self) -> str:
        """The process as one shell command line (`env K=V ... argv`)."""
        prefix = ["env", *(f"{k}={v}" for k, v in self.env.items())] if self.env else []
        return shlex.join(prefix + self.argv)


@dataclass(frozen=True)
class NodePlan:
    node_rank: int
    host: str
    role: Role
    processes: list[ProcessSpec]
    health: list[str]  # this node's own health URLs (rollout servers)


@dataclass(frozen=True)
class LaunchPlan:
    job_id: str
    run_dir: str
    placement: str
    master_addr: str
    master_port: int
    trainer_nodes: int
    rollout_nodes: int
    gpus_per_node: int
    server_urls: list[str]
    trainer_overrides: list[str]  # what the launcher adds to the user's overrides
    done_file: str  # written by trainer node 0 when training ends; rollout nodes stop on it
    nodes: list[NodePlan] = field(default_factory=list)

    def node(self, rank: int) -> NodePlan:
        if not 0 <= rank < len(self.nodes):
            raise LaunchPlanError(f"--node-rank {rank} is outside the allocation of {len(self.nodes)} node(s)")
        return self.nodes[rank]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Executables:
    """Commands used on the nodes (override for containers or non-PATH installs). Each is split like a
    shell word list, so `python -m torch.distributed.run` or `python -m vllm.entrypoints.openai.api_server`
    (the CPU wheel, whose `vllm` script fails) work too. `rollout_server="sao"` runs rollout/engines/http_server.py
    (an HF engine over vLLM's routes, a fast-starting CPU stand-in) instead of vLLM."""

    torchrun: str = "torchrun"
    vllm: str = "vllm"
    rollout_server: Literal["vllm", "sao"] = "vllm"
    python: str = "python"  # for rollout_server="sao"

    def vllm_argv(self, model: str) -> list[str]:
        words = shlex.split(self.vllm)
        # The API-server module takes the model as --model; the `vllm` script as `serve MODEL`.
        return [*words, "--model", model] if words[-1].startswith("vllm.entrypoints") else [*words, "serve", model]


def _pos_int(value: int, name: str) -> int:
    if not isinstance(value, int) or value < 1:
        raise LaunchPlanError(f"{name} must be a positive integer, got {value!r}")
    return value


def build_launch_plan(config: str, hosts: Sequence[str], *, overrides: Sequence[str] = (),
                      run_dir: str, job_id: str = "local", gpus_per_node: int | None = None,
                      trainer_nodes: int | str | None = None, model_dir: str | None = None,
                      restart_count: int = 0, exe: Executables = Executables(),
                      environ: Mapping[str, str] | None = None,
                      servers_per_node: int | None = None) -> LaunchPlan:
    """Assign roles to `hosts` and build every node's commands for `config` (+ `overrides`).

    Args:
        config: YAML path handed to `sao train` (made absolute: the nodes may start elsewhere).
        hosts: expanded node list of the allocation, in SLURM order.
        run_dir: the run directory (checkpoints, logs); stable across requeues of one job.
        gpus_per_node / trainer_nodes: allocation facts that win over cluster.* in the config. trainer_nodes
            "all": every node of the allocation, whatever it is (colocated jobs whose requeue may come back
            on another node count: the trainer resumes its checkpoint at the new data-parallel size).
        model_dir: HF checkpoint the vLLM servers load (default: model.path).
        restart_count: SLURM_RESTART_COUNT, so a requeued job does not see the last attempt's done file.
        environ: the launcher's environment (default os.environ): GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME.
        servers_per_node: rollout servers per rollout node (default gpus_per_node / rollout_tp); the
            one-machine launcher uses it to run N servers beside a trainer of G ranks.
    """
    hosts = list(hosts)
    if not hosts:
        raise LaunchPlanError("empty node list (SLURM_JOB_NODELIST)")
    config = os.path.abspath(config)
    base = load_config(config, overrides)
    c = base.cluster
    G = _pos_int(gpus_per_node if gpus_per_node is not None else c.gpus_per_node, "gpus per node (SAO_GPUS_PER_NODE)")
    if trainer_nodes == "all":
        trainer_nodes = len(hosts)
    T = _pos_int(trainer_nodes if trainer_nodes is not None else c.trainer_nodes,
                 "trainer nodes (SAO_TRAINER_NODES / cluster.trainer_nodes)")
    N = len(hosts)
    if c.placement == "disaggregated":
        if N <= T:
            raise LaunchPlanError(f"placement disaggregated: the allocation has {N} node(s) but cluster.trainer_nodes="
                                  f"{T} leaves none for vLLM; allocate more nodes (sbatch --nodes) or fewer trainers")
        R = N - T
    else:
        if N != T:
            raise LaunchPlanError(f"placement {c.placement}: the allocation has {N} node(s) "
                                  f"but cluster.trainer_nodes={T}; "
                                  "they must match (sbatch --nodes or SAO_TRAINER_NODES)")
        R = 0
    if c.placement != "embedded" and G % c.rollout_tp:
        raise LaunchPlanError(f"cluster.rollout_tp={c.rollout_tp} must divide the {G} GPUs per node")

    trainer_hosts, rollout_hosts = hosts[:T], hosts[T:]
    logs = os.path.join(run_dir, "logs")
    if servers_per_node is None:
        servers_per_node = G // c.rollout_tp if R else 0
    elif R:
        _pos_int(servers_per_node, "servers per rollout node")
    server_urls = [f"http://{h}:{c.rollout_port + i}" for h in rollout_hosts for i in range(servers_per_node)]
    master = trainer_hosts[0]
    launch_overrides = [f"cluster.trainer_nodes={T}", f"cluster.rollout_nodes={R}", f"cluster.gpus_per_node={G}",
                        f"run.dir={run_dir}"]
    if R:
        r = base.rollout
        if r.weight_transport == "reload" and exe.rollout_server == "vllm":
            raise LaunchPlanError("rollout.weight_transport=reload works with rollout/engines/http_server.py only; "
                                  "vllm serve takes nccl (GPU) or gloo (CPU builds)")
        from megatron_sao.cluster.layout import max_num_seqs

        max_seqs = max_num_seqs(base, len(server_urls))
        sync_ports = [c.weight_sync_port + i for i in range(len(server_urls))]
        if c.master_port in sync_ports:
            raise LaunchPlanError(f"cluster.weight_sync_port={c.weight_sync_port}: ports {sync_ports[0]}.."
                                  f"{sync_ports[-1]} (one per server) collide with cluster.master_port={c.master_port}")
        launch_overrides += ["rollout.backend=vllm_server", "rollout.server_urls=" + json.dumps(server_urls),
                             f"rollout.max_num_seqs={max_seqs}", f"rollout.weight_transfer_master_address={master}",
                             "rollout.weight_transfer_ports=" + json.dumps(sync_ports)]
    # Re-validate with what the job really is (types, server_urls, ...) before anything starts.
    cfg = load_config(config, [*overrides, *launch_overrides])
    # gloo groups (megatron-core's) bind where GLOO_SOCKET_IFNAME says; without a name here the
    # trainer picks the interface that routes to the master on its node (distributed/socket_ifname.py).
    gloo = gloo_ifname_from_env(os.environ if environ is None else environ)
    gloo_env = {GLOO: gloo} if gloo else {}

    nodes: list[NodePlan] = []
    for rank, host in enumerate(trainer_hosts):
        argv = [*shlex.split(exe.torchrun), f"--nnodes={T}", f"--nproc-per-node={G}", f"--node-rank={rank}",
                f"--master-addr={master}", f"--master-port={c.master_port}",
                "-m", "megatron_sao.cli", "train", config, "--resume", *overrides, *launch_overrides]
        # --resume: a requeued job continues from the run dir's latest checkpoint (fresh if none).
        env = {"SAO_NODE_RANK": str(rank), **gloo_env}
        proc = ProcessSpec(f"trainer-{rank}", argv, env, os.path.join(logs, f"trainer-node{rank}-{host}.log"))
        # Started at once: the trainer waits for the servers' /health itself (rollout/episode_driver.py),
        # so its model build overlaps their model load.
        nodes.append(NodePlan(rank, host, "trainer", [proc], health=[]))
    for j, host in enumerate(rollout_hosts):
        make = _vllm_process if exe.rollout_server == "vllm" else _sao_server_process
        procs = [make(cfg, exe, model_dir, host, i, j, logs, config, overrides) for i in range(servers_per_node)]
        urls = [f"http://{host}:{c.rollout_port + i}/health" for i in range(servers_per_node)]
        nodes.append(NodePlan(T + j, host, "rollout", procs, health=urls))
    done = os.path.join(run_dir, f".trainer-done-{job_id}-{restart_count}")
    return LaunchPlan(job_id=job_id, run_dir=run_dir, placement=c.placement, master_addr=master,
                      master_port=c.master_port, trainer_nodes=T, rollout_nodes=R, gpus_per_node=G,
                      server_urls=server_urls, trainer_overrides=launch_overrides, done_file=done, nodes=nodes)


def _vllm_process(cfg: SAOConfig, exe: Executables, model_dir: str | None, host: str, i: int, j: int,
                  logs: str, config: str, overrides: Sequence[str]) -> ProcessSpec:
    """Server i of rollout node j: GPUs [i*tp, (i+1)*tp), port rollout_port + i."""
    c, r = cfg.cluster, cfg.rollout
    gpus = ",".join(str(g) for g in range(i * c.rollout_tp, (i + 1) * c.rollout_tp))
    # The CPU build has no NCCL: its workers take the same rendezvous and routes over gloo, through
    # a transfer engine our worker extension registers (weights/vllm_worker/gloo_engine.py).
    gloo = r.weight_transport == "gloo"
    transfer = {"backend": "sao_gloo" if gloo else "nccl"}
    # vLLM serves the model under the name exactly as given, and the trainer asks for it by
    # str(Path(model.path)): "dir/" would make every request a 404 ("model does not exist").
    model = str(PurePosixPath(model_dir or cfg.model.path))
    argv = [*exe.vllm_argv(model),
            "--host", "0.0.0.0", "--port", str(c.rollout_port + i),
            "--tensor-parallel-size", str(c.rollout_tp),
            "--dtype", cfg.model.dtype,  # sample from the precision the trainer scores in
            "--max-model-len", str(r.max_total_tokens),
            "--max-num-seqs", str(r.max_num_seqs),  # the trainer's per-server cap (rollout.max_num_seqs)
            "--gpu-memory-utilization", str(r.gpu_memory_utilization),
            "--seed", str(cfg.run.seed + 1000 * j + i),
            # Log-probs after temperature/top-p: the distribution the tokens were sampled from.
            "--logprobs-mode", "processed_logprobs",
            # vLLM's neutral sampling defaults: a generation_config.json's repetition_penalty or min_p
            # would reshape that distribution away from the learner's softmax.
            "--generation-config", "vllm",
            # /inference/v1/generate: token ids in and out, with per-token weight_versions spans.
            "--enable-scale-out",
            "--weight-transfer-config", json.dumps(transfer, separators=(",", ":"))]
    if gloo:
        argv += ["--worker-extension-cls", WORKER_EXTENSION]
    if r.returns_routes:  # routing replay: every completion may carry its routed experts
        argv += ["--enable-return-routed-experts"]
    argv += list(r.vllm_serve_args)
    # Dev mode exposes /pause, /resume and the weight-update routes the trainer drives.
    env = {"VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": gpus}
    return ProcessSpec(f"vllm-{i}", argv, env, os.path.join(logs, f"rollout-node{j}-{host}-{i}.log"))


def _sao_server_process(cfg: SAOConfig, exe: Executables, model_dir: str | None, host: str, i: int, j: int,
                        logs: str, config: str, overrides: Sequence[str]) -> ProcessSpec:
    """rollout/engines/http_server.py (an HF engine) in vllm serve's place: same port, routes and health check."""
    c = cfg.cluster
    argv = [*shlex.split(exe.python), "-m", "megatron_sao.cli", "serve-rollout", config, "--host", "0.0.0.0",
            "--port", str(c.rollout_port + i), *overrides, f"run.dir={cfg.run.dir}"]
    return ProcessSpec(f"rollout-{i}", argv, {}, os.path.join(logs, f"rollout-node{j}-{host}-{i}.log"))


# ------------------------------------------------------------------------------------ rendering


def _bash_array(name: str, items: Sequence[str]) -> str:
    return f"{name}=(" + " ".join(shlex.quote(x) for x in items) + ")"


def render_bash(plan: LaunchPlan, rank: int) -> str:
    """Shell assignments for one node; slurm/common.sh evals them (every value is shlex-quoted)."""
    n = plan.node(rank)
    out = [f"SAO_ROLE={n.role}", f"SAO_HOST={shlex.quote(n.host)}", f"SAO_NODE_RANK={n.node_rank}",
           f"SAO_RUN_DIR={shlex.quote(plan.run_dir)}", f"SAO_DONE_FILE={shlex.quote(plan.done_file)}",
           f"SAO_NPROCS={len(n.processes)}"]
    for i, p in enumerate(n.processes):
        out.append(f"SAO_PROC_NAME_{i}={shlex.quote(p.name)}")
        out.append(f"SAO_PROC_LOG_{i}={shlex.quote(p.log)}")
        out.append(_bash_array(f"SAO_PROC_CMD_{i}", ["env", *(f"{k}={v}" for k, v in p.env.items()), *p.argv]))
    return "\n".join(out)


def render_text(plan: LaunchPlan) -> str:
    """Every node's commands, for `--dry-run` and for humans."""
    lines = [f"# job {plan.job_id}: placement={plan.placement} trainer_nodes={plan.trainer_nodes} "
             f"rollout_nodes={plan.rollout_nodes} gpus_per_node={plan.gpus_per_node} "
             f"master={plan.master_addr}:{plan.master_port} run_dir={plan.run_dir}"]
    for n in plan.nodes:
        lines.append(f"[node {n.node_rank} {n.host} {n.role}]")
        for p in n.processes:
            lines.append(f"  {p.shell()} > {shlex.quote(p.log)} 2>&1")
        for url in n.health:
            lines.append(f"  health {url}")
    return "\n".join(lines)


def _trainer_nodes_arg(value: str) -> int | str:
    if value == "all":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"SAO_TRAINER_NODES must be a node count or 'all', got {value!r}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m megatron_sao.cluster.launch_plan",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--nodelist", required=True, help='SLURM hostlist, e.g. "node[01-04],gpu7"')
    ap.add_argument("--node-rank", type=int, default=None, help="this node (SLURM_NODEID); needed for --format bash")
    ap.add_argument("--format", choices=("bash", "text", "json", "memory"), default="text",
                    help="memory: run the planner on the config as launched (exit 2 if refused)")
    ap.add_argument("--gpu-mem-gib", type=float, default=80.0, help="GPU memory for --format memory")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--job-id", default="local")
    ap.add_argument("--restart-count", type=int, default=0)
    ap.add_argument("--gpus-per-node", type=int, default=None)
    ap.add_argument("--trainer-nodes", type=_trainer_nodes_arg, default=None,
                    help='a count, or "all": every node of the allocation (colocated)')
    ap.add_argument("--model-dir", default=None, help="HF checkpoint for vllm serve (default model.path)")
    ap.add_argument("--torchrun", default=Executables.torchrun)
    ap.add_argument("--vllm", default=Executables.vllm)
    ap.add_argument("--rollout-server", choices=("vllm", "sao"), default="vllm",
                    help="what rollout nodes run: vllm serve, or rollout/engines/http_server.py (HF engine, CPU)")
    ap.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    return ap


def _check_memory(plan: LaunchPlan, args: argparse.Namespace) -> int:
    """The planner's verdict on the config exactly as the trainer will see it (0 fits, 2 refused)."""
    from megatron_sao.cluster.layout import LayoutError
    from megatron_sao.cluster.planner import PlanOptions, render
    from megatron_sao.cluster.planner import plan as make_plan

    cfg = load_config(os.path.abspath(args.config), [*args.overrides, *plan.trainer_overrides])
    hf = os.path.join(args.model_dir, "config.json") if args.model_dir else None
    try:
        p = make_plan(cfg, hf, PlanOptions(gpu_mem_gib=args.gpu_mem_gib))
    except LayoutError as e:
        for issue in e.issues:
            print(f"sao plan: refused: {issue}", file=sys.stderr)
        return 2
    print(render(p, cfg))
    for issue in p.problems:
        print(f"sao plan: refused: {issue}", file=sys.stderr)
    return 0 if p.fits else 2


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)  # overrides may follow options
    try:
        plan = build_launch_plan(args.config, expand_hostlist(args.nodelist), overrides=args.overrides,
                                 run_dir=args.run_dir, job_id=args.job_id, gpus_per_node=args.gpus_per_node,
                                 trainer_nodes=args.trainer_nodes, model_dir=args.model_dir,
                                 restart_count=args.restart_count,
                                 exe=Executables(args.torchrun, args.vllm, args.rollout_server))
        if args.format == "bash":
            if args.node_rank is None:
                raise LaunchPlanError("--format bash needs --node-rank (SLURM_NODEID)")
            print(render_bash(plan, args.node_rank))
        elif args.format == "memory":
            return _check_memory(plan, args)
        elif args.format == "json":
            print(json.dumps(plan.to_dict(), indent=2))
        else:
            print(render_text(plan))
    except (LaunchPlanError, HostlistError, ConfigError, ValueError) as e:
        print(f"launch_plan: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
