"""Where the project's evaluation data lives (shared/data beside the checkout; see README)."""

import os
from pathlib import Path

from tests.paths import REPO


def shared_data_dir() -> Path:
    """$SAO_DATA_DIR, else ../shared/data beside the checkout, else /work/shared/data. Fails loudly:
    these tests check real dataset files, and a missing copy is a set-up error, not a skip."""
    candidates = [os.environ.get("SAO_DATA_DIR"), REPO.parent / "shared" / "data", "/work/shared/data"]
    for c in candidates:
        if c and (Path(c) / "aime25.jsonl").exists():
            return Path(c)
    raise FileNotFoundError(f"evaluation data not found in any of {[str(c) for c in candidates if c]}; "
                            "set SAO_DATA_DIR to the project's shared/data folder")
