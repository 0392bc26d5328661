"""SIGTERM or SIGKILL to a `sao` command that runs an in-process vLLM engine (`sao eval`, `sao sft`'s and
`sao value-pretrain`'s rollouts, `sao train`): its EngineCore process does not outlive the command.

Python's default for SIGTERM is to die at once; the EngineCore child then kept running, orphaned, with
the model and its KV cache in memory (what `timeout` or a scheduler's cancel left behind). `sao` turns
SIGTERM into SystemExit (cli.exit_on_sigterm), so the engine's `finally: close()` runs. A SIGKILL runs
nothing of `sao`: the orphan guard process kills the EngineCore then.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from megatron_sao.models.builtin import materialize_builtin_model

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _children(pids: list[int]) -> list[int]:
    """The live children of ``pids`` (vLLM's CPU worker runs in a child of the EngineCore)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text() if d.name.isdigit() else ""
        except OSError:
            continue
        if stat and int(stat[stat.rindex(")") + 2:].split()[1]) in pids and _running(int(d.name)):
            out.append(int(d.name))
    return out


def _running(pid: int) -> bool:
    """A live process (a zombie holds no memory: it counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_signal_during_sao_eval_leaves_no_engine_core_process(tmp_path, sig):
    """SIGTERM: `sao` closes its engine. SIGKILL (the OOM killer) runs no code of `sao`: the orphan guard
    (rollout/engines/orphan_guard.py) kills the EngineCore it was handed."""
    model = materialize_builtin_model("tiny_qwen3_moe_ci", tmp_path / "model", 3)
    log = tmp_path / "eval.log"
    # A file, not a pipe: an orphaned EngineCore would hold a pipe open after the command exits.
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "megatron_sao.cli", "eval", "tests/e2e/tiny_ci.yaml",
                                 "--checkpoint", str(model), "rollout.backend=vllm", "env.eval_size=2000",
                                 f"run.dir={tmp_path / 'run'}"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    cores: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not cores and time.monotonic() < deadline and proc.poll() is None:
            found = re.search(r"vllm:\S+: up \(EngineCore pid ([\d,]+);", log.read_text())
            cores = [int(p) for p in found.group(1).split(",")] if found else []
            time.sleep(0.5)
        assert cores, f"the engine never came up:\n{log.read_text()[-3000:]}"
        time.sleep(2)  # episodes in flight
        assert proc.poll() is None and all(_running(p) for p in cores), log.read_text()[-3000:]
        cores += _children(cores)
        proc.send_signal(sig)
        # SIGTERM: `sao` exits by its handler with 128 + 15; SIGKILL: killed by the signal itself.
        assert proc.wait(120) == (128 + sig if sig == signal.SIGTERM else -sig), log.read_text()[-3000:]
        deadline = time.monotonic() + 30
        while any(_running(p) for p in cores) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [p for p in cores if _running(p)]
        assert not left, f"EngineCore or its worker {left} outlived `sao eval`:\n{log.read_text()[-3000:]}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in cores + _children(cores):  # whatever the outcome, nothing of this test keeps running
            if _running(p):
                os.kill(p, signal.SIGKILL)
