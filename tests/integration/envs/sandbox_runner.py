"""Runs sandbox calls for test_sandbox.py in a process of its own, as whatever user it was started as.

The hostile-code tests start it as root and, through setpriv, as an unprivileged user: the sandbox's
non-root mode is exercised even though CI runs as root. Reads {"pool": {...}, "cases": [...]} on
stdin, runs each case's code (``{PARENT}`` replaced by this process's pid: the "trainer" the code
attacks) and prints one JSON object with the results. Cases with ``"shell": true`` are bash commands run one
after another in one sandbox workspace (an agent's commands: envs/sandbox_workspace.py), which the runner
then copies back as grading does (``fork``) and removes. Standard library + the sandbox only.
"""

import asyncio
import dataclasses
import json
import os
import resource
import sys
import time

from megatron_sao.envs.sandbox import SandboxError, SandboxLimits, SandboxPool


def _own_state() -> dict:
    """What a call could change in the trainer from outside: its limits, priority, CPU affinity."""
    return {"nofile": list(resource.getrlimit(resource.RLIMIT_NOFILE)), "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "affinity": sorted(os.sched_getaffinity(0)), "cpu": list(resource.getrlimit(resource.RLIMIT_CPU))}


async def main() -> None:
    spec = json.load(sys.stdin)
    pool = SandboxPool(**spec["pool"])
    out = {"pid": os.getpid(), "uid": os.getuid(), "results": {}, "self_before": _own_state()}
    ws = None  # one workspace for every "shell" case: an agent's commands, one after another
    for case in spec["cases"]:
        code = case["code"].replace("{PARENT}", str(os.getpid())).replace("{TMP}", os.environ.get("TMPDIR", "/tmp"))
        t0 = time.monotonic()
        try:
            if case.get("shell"):
                ws = ws or await pool.open_workspace(None)
                res = await ws.shell(code, SandboxLimits(**case.get("limits", {})))
            else:
                res = await pool.run(code, SandboxLimits(**case.get("limits", {})))
            out["results"][case["name"]] = {**dataclasses.asdict(res), "elapsed_s": time.monotonic() - t0}
        except SandboxError as e:
            out["results"][case["name"]] = {"sandbox_error": str(e)}
    if ws is not None:  # what the commands planted, copied back by the host (grading's fork)
        copy = await ws.fork()
        out["fork"] = {name: {"link": os.path.islink(copy.path / name), "exists": os.path.lexists(copy.path / name)}
                       for name in ("leak", "fifo")}
        await copy.close()
        await ws.close()
        out["workspace_removed"] = not ws.path.exists()
    out["alive"] = True  # the code did not kill its parent
    out["self_after"] = _own_state()
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
