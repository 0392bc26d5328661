"""Test-only fault injection: kill this process at a named point of the real code.

    SAO_FAULT=<point>[:<n>]   SIGKILL this process the n-th time (default: the first) it reaches <point>

The resume tests use it to stop a trainer at an exact moment (mid-rollout, mid-step, mid-checkpoint
write, right after the commit) instead of racing a timer against it. SIGKILL, not an exception:
nothing may run after the point (no `finally`, no atexit), exactly like `kill -9` or a lost node.
Unset (always outside tests) `fault_point` is one dict lookup.

Points (where they sit is the contract the tests rely on):
  buffer_put                 a finished trajectory's file was written (buffer.py, put)
  batch_taken                the trainer took a batch, nothing of the step is written yet (buffer.py, take)
  batch_logged               a step's metrics and batches.jsonl lines were written, no checkpoint yet (run_dir.py)
  checkpoint_save_scheduled  an asynchronous checkpoint's writers were started, nothing of it committed (checkpoints.py)
  checkpoint_parts_written   a checkpoint's files are all in step_N.tmp-<id>, not yet renamed (checkpoints.py)
  checkpoint_committed       `latest` names the new checkpoint; the buffer is not yet released (checkpoints.py)
"""

from __future__ import annotations

import os
import signal

POINTS = ("buffer_put", "batch_taken", "batch_logged", "checkpoint_save_scheduled", "checkpoint_parts_written",
          "checkpoint_committed")
_counts: dict[str, int] = {}


def _parse(spec: str | None) -> tuple[str, int] | None:
    if not spec:
        return None
    name, _, n = spec.partition(":")
    if name not in POINTS:
        raise ValueError(f"SAO_FAULT={spec!r}: unknown point {name!r}; known: {list(POINTS)}")
    return name, int(n or 1)


_TARGET = _parse(os.environ.get("SAO_FAULT"))


def fault_point(name: str) -> None:
    """Kill the process here if SAO_FAULT names this point and this is its n-th visit."""
    if _TARGET is None or _TARGET[0] != name:
        return
    _counts[name] = _counts.get(name, 0) + 1
    if _counts[name] == _TARGET[1]:
        os.kill(os.getpid(), signal.SIGKILL)
