"""A real two-node SLURM cluster on one machine: munged, slurmctld and two slurmd daemons.

    bash tools/slurm_local/install.sh                      # Debian's slurm-wlm + munge (root)
    python tools/slurm_local/cluster.py up --dir /tmp/sao-slurm   # prints the SLURM_CONF to export
    SLURM_CONF=/tmp/sao-slurm/slurm.conf sbatch --nodes=2 --gpus-per-node=0 slurm/sao_aime.sh
    python tools/slurm_local/cluster.py down --dir /tmp/sao-slurm

Everything lives in one directory (configuration, munge key and socket, state, spool, logs); nothing
of the packages' own configuration or services is used. The two nodes are `sao-n1` and `sao-n2`
(127.0.0.2 and 127.0.0.3: any 127/8 address is this machine), added to /etc/hosts when missing
(the launch plan uses the node names as host names, as on a real cluster). One partition `sao`;
processes are tracked by parent pid (proctrack/linuxproc: no cgroup delegation needed), so a
signal to a step reaches every process the step started, as proctrack/cgroup does on clusters.

tests/cluster/test_slurm_e2e.py brings it up with `SlurmCluster(dir).start()` and stops it after.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from megatron_sao.distributed.ports import free_port

NODES = {"sao-n1": "127.0.0.2", "sao-n2": "127.0.0.3"}
PARTITION = "sao"
DAEMONS = ("munged", "slurmctld", "slurmd")


class ClusterError(RuntimeError):
    """The cluster cannot be brought up here; the message says what is missing or what failed."""


def missing_tools() -> list[str]:
    """The SLURM/munge programs this machine lacks (tools/slurm_local/install.sh installs them)."""
    need = [*DAEMONS, "sbatch", "scontrol", "squeue", "scancel", "sacct", "srun"]
    return [t for t in need if shutil.which(t) is None and not Path("/usr/sbin", t).exists()]


def _which(tool: str) -> str:
    return shutil.which(tool) or str(Path("/usr/sbin", tool))


def ensure_hosts(path: str = "/etc/hosts") -> None:
    """Name resolution for the nodes (the launch plan's master address and server URLs use them)."""
    text = Path(path).read_text()
    names = {w for line in text.splitlines() if not line.lstrip().startswith("#") for w in line.split()[1:]}
    missing = [f"{addr} {name}\n" for name, addr in NODES.items() if name not in names]
    if missing:
        try:
            with open(path, "a") as f:
                f.write(("" if text.endswith("\n") else "\n") + "".join(missing))
        except PermissionError as e:
            raise ClusterError(f"{path} lacks {', '.join(NODES)} and is not writable here (run as root, or add "
                               f"{'; '.join(m.strip() for m in missing)})") from e


def slurm_conf(d: Path, ctl_port: int, node_ports: dict[str, int], cpus: int, user: str) -> str:
    """slurm.conf of the one-machine cluster (every path inside ``d``). cred_expire=10: a requeued job
    may start again 10 s after its last attempt ended (SLURM's default, 120 s, is also the delay; SLURM
    refuses values under 5 s, and the credential must outlive the launch on a loaded machine); the
    schedulers look at pending jobs every 2 s (SLURM's 60 s and 30 s would add up to a minute to it)."""
    nodes = "\n".join(f"NodeName={n} NodeAddr={a} Port={node_ports[n]} CPUs={cpus} RealMemory=1000 State=UNKNOWN"
                      for n, a in NODES.items())
    return f"""\
ClusterName=sao-local
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmctldPort={ctl_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket,cred_expire=10
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={d}/log/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
JobRequeue=1
KillWait=60
MinJobAge=3600
SlurmdTimeout=60
InactiveLimit=0
{nodes}
PartitionName={PARTITION} Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """munged + slurmctld + one slurmd per node, all in ``directory`` (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike, cpus_per_node: int = 2) -> None:
        self.dir = Path(directory).resolve()
        self.cpus = cpus_per_node
        self.procs: list[tuple[str, subprocess.Popen]] = []

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    def env(self) -> dict[str, str]:
        """What a client (sbatch, squeue, scontrol) needs to reach this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout_s: float = 60.0) -> "SlurmCluster":
        missing = missing_tools()
        if missing:
            raise ClusterError(f"missing {', '.join(missing)}: run `bash tools/slurm_local/install.sh` (root)")
        ensure_hosts()
        d = self.dir
        for sub in ("munge", "state", "spool", "run", "log"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        # munged refuses a key or socket directory that others may write
        os.chmod(d, 0o755)
        os.chmod(d / "munge", 0o700)
        key = d / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
        ports = {n: free_port() for n in NODES}
        self.conf.write_text(slurm_conf(d, free_port(), ports, self.cpus, user))
        try:
            self._spawn("munged", [_which("munged"), "--foreground", "--force", f"--key-file={key}",
                                   f"--socket={d}/munge/munge.socket", f"--pid-file={d}/munge/munged.pid",
                                   f"--log-file={d}/log/munged.log", f"--seed-file={d}/munge/munged.seed"])
            self._wait(lambda: (d / "munge" / "munge.socket").exists(), timeout_s, "munged's socket")
            self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            self._wait(self._ctl_up, timeout_s, "slurmctld to answer `scontrol ping`")
            for n in NODES:
                self._spawn(f"slurmd-{n}", [_which("slurmd"), "-D", "-N", n, "-f", str(self.conf)])
            self._wait(self._nodes_idle, timeout_s, f"nodes {', '.join(NODES)} to be idle")
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.dir / "log" / f"{name}.stdout", "ab")
        self.procs.append((name, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL, env=self.env())))
        log.close()

    def _wait(self, ok, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ok():
            dead = [(n, p.returncode) for n, p in self.procs if p.poll() is not None]
            if dead:
                raise ClusterError(f"{dead[0][0]} exited with {dead[0][1]} while waiting for {what}; "
                                   f"logs in {self.dir / 'log'}:\n{self.logs_tail()}")
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out after {timeout_s:g}s waiting for {what}; logs in "
                                   f"{self.dir / 'log'}:\n{self.logs_tail()}")
            time.sleep(0.3)

    def _run(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), capture_output=True, text=True, env=self.env(), timeout=30)

    def _ctl_up(self) -> bool:
        return "is UP" in self._run("scontrol", "ping").stdout

    def _nodes_idle(self) -> bool:
        out = self._run("sinfo", "-h", "-N", "-o", "%N %t").stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n) == "idle" for n in NODES)

    def logs_tail(self, chars: int = 3000) -> str:
        parts = []
        for f in sorted((self.dir / "log").glob("*")):
            if f.is_file():
                parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def stop(self, grace_s: float = 15.0, jobs_grace_s: float = 90.0) -> None:
        """Cancel what is still queued or running and wait for its processes to end (at most
        ``jobs_grace_s``: KillWait's SIGTERM -> SIGKILL and the epilog), then stop the daemons
        (slurmd, slurmctld, munged). Stopping slurmd under a running job would leave its processes
        (a trainer, vLLM servers) running with nobody to end them."""
        if any(n == "slurmctld" and p.poll() is None for n, p in self.procs):
            cancel_jobs(self.env(), jobs_grace_s)
        for name, p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(grace_s)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        self.procs = []


def cancel_jobs(env: dict[str, str], timeout_s: float) -> list[str]:
    """scancel every job of the partition and wait until none is left in squeue (a completing job
    stays listed until its steps' processes ended). Returns the jobs still listed at the timeout."""
    left: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        subprocess.run(["scancel", "--full", f"--partition={PARTITION}"], capture_output=True, env=env, timeout=30)
        while True:
            q = subprocess.run(["squeue", "-h", f"--partition={PARTITION}", "-o", "%i %T"], capture_output=True,
                               text=True, env=env, timeout=30)
            left = q.stdout.split("\n") if q.returncode == 0 else []
            left = [line for line in left if line.strip()]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(1)
    except (OSError, subprocess.TimeoutExpired):  # the controller no longer answers: nothing to wait for
        return left
    if left:
        print(f"slurm_local: jobs still ending after {timeout_s:g}s: {'; '.join(left)}", file=sys.stderr)
    return left


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("up", "down"))
    ap.add_argument("--dir", default="/tmp/sao-slurm")
    ap.add_argument("--cpus-per-node", type=int, default=2)
    args = ap.parse_args(argv)
    d = Path(args.dir).resolve()
    if args.action == "up":
        c = SlurmCluster(d, args.cpus_per_node).start()
        # The daemons keep running after this command: record their pids for `down`.
        (d / "run" / "daemons.pids").write_text("\n".join(str(p.pid) for _, p in c.procs))
        print(f"export SLURM_CONF={c.conf}")
        return 0
    pids = d / "run" / "daemons.pids"
    if not pids.exists():
        print(f"no cluster recorded in {d}", file=sys.stderr)
        return 1
    cancel_jobs({**os.environ, "SLURM_CONF": str(d / "slurm.conf")}, 90.0)
    for pid in reversed([int(x) for x in pids.read_text().split()]):
        if _pid_alive(pid):
            os.kill(pid, signal.SIGTERM)
    pids.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
