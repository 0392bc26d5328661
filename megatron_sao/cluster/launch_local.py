"""The multi-node launch on one machine: rollout server processes + a torchrun trainer on localhost.

    python -m megatron_sao.cluster.launch_local --config examples/tiny_cpu.yaml \
        --trainer-ranks 2 --rollout-servers 1 [--run-dir runs/local] [key=value ...]

starts `sao serve-rollout` N times (the HF-engine HTTP server with vllm serve's routes), waits
for each GET /health, then runs `torchrun --nproc-per-node R -m megatron_sao.cli train` with
`rollout.backend=vllm_server` and the servers' URLs, exactly the shape of a disaggregated SLURM
job, so CI exercises the same HTTP rollout path, rendezvous and shutdown logic. The exit code is
the trainer's; if a server dies first the run fails (1) and everything is stopped. With
`--rollout-servers 0` the trainer runs with the config's own (embedded) rollout backend.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Sequence

from megatron_sao.cluster.launch_plan import ProcessSpec
from megatron_sao.cluster.supervisor import Supervisor, SupervisorError
from megatron_sao.config import ConfigError, load_config

HOST = "127.0.0.1"


@dataclass(frozen=True)
class LocalPlan:
    servers: list[ProcessSpec]
    trainer: ProcessSpec
    health: list[str]
    server_urls: list[str]
    run_dir: str


def free_port() -> int:
    """An ephemeral TCP port free right now (a tiny race remains; fine for CI on one machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def build_local_plan(config: str, *, trainer_ranks: int, rollout_servers: int, run_dir: str,
                     overrides: Sequence[str] = (), ports: Sequence[int] | None = None,
                     master_port: int | None = None, python: str = sys.executable,
                     threads_per_rank: int = 1) -> LocalPlan:
    """Commands of a local run. `ports` (one per server) and `master_port` default to free ports."""
    if trainer_ranks < 1:
        raise ValueError(f"--trainer-ranks must be >= 1, got {trainer_ranks}")
    if rollout_servers < 0:
        raise ValueError(f"--rollout-servers must be >= 0, got {rollout_servers}")
    config = os.path.abspath(config)
    ports = list(ports) if ports is not None else [free_port() for _ in range(rollout_servers)]
    if len(ports) != rollout_servers:
        raise ValueError(f"got {len(ports)} ports for {rollout_servers} rollout servers")
    urls = [f"http://{HOST}:{p}" for p in ports]
    logs = os.path.join(run_dir, "logs")
    # CPU ranks: one thread each, or two ranks on a 2-core machine fight over the cores.
    env = {"OMP_NUM_THREADS": str(threads_per_rank), "PYTHONUNBUFFERED": "1"}
    servers = [ProcessSpec(f"rollout-{i}", [python, "-m", "megatron_sao.cli", "serve-rollout", config,
                                            "--host", HOST, "--port", str(port), *overrides,
                                            f"run.dir={run_dir}"],
                           env, os.path.join(logs, f"rollout-local-{i}.log"))
               for i, port in enumerate(ports)]
    launch = [f"run.dir={run_dir}", "cluster.trainer_nodes=1", f"cluster.gpus_per_node={trainer_ranks}"]
    if rollout_servers:
        launch += ["cluster.placement=disaggregated", f"cluster.rollout_nodes={rollout_servers}",
                   "rollout.backend=vllm_server", "rollout.server_urls=" + json.dumps(urls)]
    # Validate the final config now: a typo should fail before any process starts.
    load_config(config, [*overrides, *launch])
    mport = master_port if master_port is not None else free_port()
    trainer = ProcessSpec("trainer", [python, "-m", "torch.distributed.run", "--nnodes=1",
                                      f"--nproc-per-node={trainer_ranks}", f"--master-addr={HOST}",
                                      f"--master-port={mport}", "-m", "megatron_sao.cli", "train", config,
                                      *overrides, *launch],
                          {**env, "SAO_WEIGHT_SYNC_PORT": str(free_port() if master_port is None else mport + 1)},
                          os.path.join(logs, "trainer-local.log"))
    return LocalPlan(servers, trainer, [u + "/health" for u in urls], urls, run_dir)


def run_local(plan: LocalPlan, *, health_timeout_s: float = 300.0, grace_s: float = 30.0) -> int:
    """Start the servers, wait for /health, run the trainer; return its exit code (1 if a server died)."""
    sup = Supervisor(grace_s=grace_s)

    def _on_signal(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds into `with sup`, which stops every process

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with sup:
            for s in plan.servers:
                sup.start(s.name, s.argv, s.log, s.env)
            try:
                sup.wait_healthy(plan.health, health_timeout_s)
            except SupervisorError as e:
                print(f"launch_local: {e}", file=sys.stderr)
                return 1
            sup.start(plan.trainer.name, plan.trainer.argv, plan.trainer.log, plan.trainer.env)
            name, rc = sup.wait_any()
            if name != "trainer":
                print(f"launch_local: {name} exited with {rc} before the trainer finished", file=sys.stderr)
                return 1
            print(f"launch_local: trainer exited with {rc} (logs in {plan.run_dir}/logs)", file=sys.stderr)
            return rc
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_sao.cluster.launch_local", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--trainer-ranks", type=int, default=2)
    ap.add_argument("--rollout-servers", type=int, default=1)
    ap.add_argument("--run-dir", default="runs/local")
    ap.add_argument("--health-timeout-s", type=float, default=300.0)
    ap.add_argument("--grace-s", type=float, default=30.0)
    ap.add_argument("--print", action="store_true", help="print the commands and exit")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)  # overrides may follow options
    try:
        plan = build_local_plan(args.config, trainer_ranks=args.trainer_ranks, rollout_servers=args.rollout_servers,
                                run_dir=os.path.abspath(args.run_dir), overrides=args.overrides)
    except (ValueError, ConfigError) as e:
        print(f"launch_local: error: {e}", file=sys.stderr)
        return 2
    if args.print:
        for p in [*plan.servers, plan.trainer]:
            print(p.shell())
        return 0
    return run_local(plan, health_timeout_s=args.health_timeout_s, grace_s=args.grace_s)


if __name__ == "__main__":
    sys.exit(main())
