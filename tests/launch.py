"""The torchrun command line the tests launch multi-rank workers and `sao` runs with.

Found beside the interpreter running the tests (the venv's bin/, whichever venv or checkout that is),
not at a path under the repository: a worktree or CI image with its venv elsewhere runs the same.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def torchrun_cmd(nproc: int, *args: str) -> list[str]:
    """``torchrun --nproc_per_node <nproc> --standalone <args...>``: the ``torchrun`` script next to
    ``sys.executable``, else ``python -m torch.distributed.run`` (the same launcher) on that interpreter."""
    exe = Path(sys.executable).parent / "torchrun"
    launcher = [str(exe)] if os.access(exe, os.X_OK) else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, "--nproc_per_node", str(nproc), "--standalone", *args]
