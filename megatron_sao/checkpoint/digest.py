"""Content digest of a model directory: what identifies a model's weights across checkouts and machines."""

from __future__ import annotations

import hashlib
from pathlib import Path


def _update(h, path: Path) -> None:
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            h.update(chunk)


def file_digest(path: str | Path) -> str:
    """sha256 of one file's bytes."""
    h = hashlib.sha256()
    _update(h, Path(path))
    return h.hexdigest()


def dir_digest(model_dir: str | Path) -> str:
    """sha256 over every file of a directory (names and bytes, in name order; sub-directories ignored).

    Two directories with the same files give the same digest wherever they lie, so a model rebuilt
    bit for bit elsewhere keys the same caches and result files."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(model_dir).iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0")
        _update(h, f)
    return h.hexdigest()
