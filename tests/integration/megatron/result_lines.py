"""Reading the `RESULT <tag> <json>` lines that multi-rank workers print.

Not line by line: every rank shares torchrun's stdout, so a rank's line can arrive glued to another
rank's output ("...warningRESULT pp2 {...}" or "RESULT a {...}RESULT b {...}"). A line-start parser
then drops a result silently and a test fails on a missing key, as tests here did now and then in CI
and under load.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from tests.paths import REPO


def parse_tagged(out: str) -> dict[str, object]:
    """Every `RESULT <tag> <json>` anywhere in ``out``, by tag (a later one with the same tag wins)."""
    dec = json.JSONDecoder()
    return {m.group(1): dec.raw_decode(out, m.end())[0] for m in re.finditer(r"RESULT (\S+) (?=[\[{\"\d-])", out)}


def parse_untagged(out: str) -> list:
    """Every `RESULT <json>` (no tag) anywhere in ``out``, in order."""
    dec = json.JSONDecoder()
    return [dec.raw_decode(out, m.end())[0] for m in re.finditer(r"RESULT (?=[\[{])", out)]


def run_worker(worker: str, *args: str, done: str, timeout: int = 400) -> dict[str, object]:
    """Run a one-process Megatron worker module (``python -m``, a fresh interpreter: ensure_cpu_compat patches torch
    process-wide) outside any torchrun environment; check it exited 0 and printed ``done``; return
    its `RESULT <tag> <json>` lines by tag."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", worker, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert done in proc.stdout, proc.stdout[-3000:]
    return parse_tagged(proc.stdout)
