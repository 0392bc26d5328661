"""One cgroup per sandbox call: memory and process count of the call's whole process tree.

Rlimits are per process (RLIMIT_AS) or per uid (RLIMIT_NPROC); a call that forks 16 processes of
1 GiB each uses 16 GiB. A cgroup bounds the tree as a whole and its OOM kill is reported. It needs a
writable cgroup hierarchy, in practice root:

- cgroup v2 (unified): a `sao-sandbox` group at the hierarchy root (the only v2 group that may hold
  processes and still give controllers to its children) with `memory` and `pids` enabled, one child
  per call with memory.max, memory.swap.max = 0 and pids.max; cleanup writes cgroup.kill.
- cgroup v1: the `memory` and `pids` hierarchies, one child per call under the trainer's own group
  (so the trainer's limits still apply), with memory.limit_in_bytes (+ memsw when accounted) and
  pids.max; cleanup kills what cgroup.procs lists.

`CgroupFactory.detect()` returns None where neither is writable (non-root, a read-only /sys/fs/cgroup)
and the sandbox falls back to per-process limits, saying so in the result's `isolation`.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

GROUP = "sao-sandbox"


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, super options) of the cgroup mounts this process sees."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _, opts = right.split()[:3]
            if fstype in ("cgroup", "cgroup2"):
                out.append((left.split()[4], fstype, set(opts.split(","))))
    return out


def _own_path(controller: str | None) -> str:
    """This process's cgroup path in the v1 hierarchy of `controller` (None: the v2 entry)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            if (controller is None and ctrls == "") or (controller and controller in ctrls.split(",")):
                return path
    return "/"


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


class CallCgroup:
    """The cgroup(s) of one call: join them with `procs_files`, then `oom_killed`, `close`."""

    def __init__(self, dirs: list[Path], v2: bool) -> None:
        self.dirs, self.v2 = dirs, v2

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def oom_killed(self) -> bool:
        for d in self.dirs:
            name = "memory.events" if self.v2 else "memory.oom_control"
            try:
                text = (d / name).read_text()
            except OSError:
                continue
            counts = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
            if int(counts.get("oom_kill", 0)) > 0:
                return True
            if not self.v2 and (d / "memory.failcnt").exists() and "oom_kill" not in counts:
                return int((d / "memory.failcnt").read_text()) > 0  # old kernels: limit was hit
        return False

    def kill_all(self) -> None:
        for d in self.dirs:
            if self.v2 and (d / "cgroup.kill").exists():
                _write(d / "cgroup.kill", "1")
                continue
            for _ in range(50):  # v1: processes may fork while we kill; repeat until empty
                pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.002)

    def close(self) -> None:
        """Kill anything left and remove the group (retrying while the kernel reaps)."""
        self.kill_all()
        for d in self.dirs:
            for _ in range(200):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.005)


class CgroupFactory:
    def __init__(self, bases: list[Path], v2: bool) -> None:
        self.bases, self.v2 = bases, v2

    @property
    def kind(self) -> str:
        return "cgroup2" if self.v2 else "cgroup1"

    @classmethod
    def detect(cls, mounts: list[tuple[str, str, set[str]]] | None = None) -> "CgroupFactory | None":
        mounts = _mounts() if mounts is None else mounts
        try:
            v1 = {c: m for m, t, opts in mounts if t == "cgroup" for c in ("memory", "pids") if c in opts}
            if len(v1) == 2:
                bases = [Path(v1[c] + _own_path(c)) / GROUP for c in ("memory", "pids")]
                for b in bases:
                    b.mkdir(exist_ok=True)
                return cls(bases, v2=False)
            unified = [m for m, t, _ in mounts if t == "cgroup2"]
            for m in unified:
                root = Path(m)
                if not {"memory", "pids"} <= set((root / "cgroup.controllers").read_text().split()):
                    continue
                _write(root / "cgroup.subtree_control", "+memory +pids")
                base = root / GROUP
                base.mkdir(exist_ok=True)
                _write(base / "cgroup.subtree_control", "+memory +pids")
                return cls([base], v2=True)
        except OSError:
            return None
        return None

    def create(self, memory_bytes: int, max_pids: int) -> CallCgroup:
        name = f"call-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        dirs = [b / name for b in self.bases]
        for d in dirs:
            d.mkdir()
        try:
            for d in dirs:
                if self.v2:
                    _write(d / "memory.max", str(memory_bytes))
                    if (d / "memory.swap.max").exists():
                        _write(d / "memory.swap.max", "0")
                    _write(d / "pids.max", str(max_pids))
                elif (d / "memory.limit_in_bytes").exists():
                    _write(d / "memory.limit_in_bytes", str(memory_bytes))
                    if (d / "memory.memsw.limit_in_bytes").exists():
                        _write(d / "memory.memsw.limit_in_bytes", str(memory_bytes))
                else:
                    _write(d / "pids.max", str(max_pids))
        except OSError:
            CallCgroup(dirs, self.v2).close()
            raise
        return CallCgroup(dirs, self.v2)
