"""Write a directory all-or-nothing: build it under a temporary name, rename it into place.

A crash or an exception while writing leaves no partial output: the temp directory (next to the
target, so the final rename stays on one filesystem and is atomic) is removed on any error.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator


def check_output_dir(target: str | os.PathLike, overwrite: bool) -> Path:
    """Fail early (before any work) if `target` exists, is non-empty and overwrite is False."""
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"output path {target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise FileExistsError(f"output directory {target} exists and is not empty (pass --overwrite / overwrite=True)")
    return target


@contextlib.contextmanager
def atomic_output_dir(target: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temp dir; on normal exit it replaces `target`, on error it is deleted."""
    target = check_output_dir(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if target.exists():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
