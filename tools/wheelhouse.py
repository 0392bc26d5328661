"""Print the wheels of a wheelhouse that this Python needs: a distribution it lacks, or has at another version.

    python tools/wheelhouse.py .whl/*.whl

tools/gpu_check_device.sh installs only these, so a bare GPU box keeps its own torch and numpy and
gets what it lacks (megatron-core) from the carried folder. Names and versions come from the wheel
file names (PEP 427: `{distribution}-{version}(-{build})?-{python}-{abi}-{platform}.whl`).
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
from pathlib import Path


def wheel_name_version(path: str) -> tuple[str, str]:
    parts = Path(path).name.removesuffix(".whl").split("-")
    if len(parts) not in (5, 6) or not path.endswith(".whl"):
        raise ValueError(f"{path}: not a wheel file name (name-version[-build]-python-abi-platform.whl)")
    return re.sub(r"[-_.]+", "-", parts[0]).lower(), parts[1]


def needed(paths: list[str]) -> list[str]:
    out = []
    for p in paths:
        name, version = wheel_name_version(p)
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            have = None
        if have != version:
            out.append(p)
    return out


if __name__ == "__main__":
    try:
        for path in needed(sys.argv[1:]):  # one per line, nothing at all when none is needed (not an empty line)
            print(path)
    except ValueError as e:
        sys.exit(f"wheelhouse: {e}")
