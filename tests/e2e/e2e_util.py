"""Shared helpers of the end-to-end tests."""
import os
import subprocess
import sys
from pathlib import Path

from tests.launch import torchrun_cmd

CONFIG = str(Path(__file__).with_name("tiny_ci.yaml"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def sao(*args, timeout=600, torchrun=0, env=None):
    """Run the real CLI in a subprocess (each stage builds its own Megatron world); `env` adds variables."""
    if torchrun:
        cmd = torchrun_cmd(torchrun, "-m", "megatron_sao.cli", *args)
    else:
        cmd = [sys.executable, "-m", "megatron_sao.cli", *args]
    p = subprocess.run(cmd, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(args)} failed ({p.returncode}):\n{p.stderr[-4000:]}"
    return p


