"""The run directory: everything a run writes, and the only place resume reads from.

    <run>/config.yaml              resolved config snapshot
    <run>/metrics.jsonl            one JSON object per step (append, flushed each step)
    <run>/tensorboard/             TensorBoard event files with the same scalars
    <run>/buffer/                  finished trajectories not yet covered by a checkpoint
    <run>/checkpoints/step_000012/ actor/ critic/ trainer_state.json (data position, RNG, counters)
    <run>/checkpoints/latest       name of the newest complete checkpoint

A checkpoint is written into `step_N.tmp-*` and renamed into place, then `latest` is replaced
atomically: a crash mid-save leaves the previous checkpoint as the latest, never a partial one.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


class RunDir:
    def __init__(self, path: str | os.PathLike, is_writer: bool = True):
        self.path = Path(path)
        self.is_writer = is_writer
        self.ckpt_root = self.path / "checkpoints"
        self.buffer_dir = self.path / "buffer"
        if is_writer:
            self.ckpt_root.mkdir(parents=True, exist_ok=True)
        self._tb = None

    # ------------------------------------------------------------------ checkpoints
    def latest_checkpoint(self) -> Path | None:
        marker = self.ckpt_root / "latest"
        if not marker.exists():
            return None
        path = self.ckpt_root / marker.read_text().strip()
        if not (path / "trainer_state.json").exists():
            raise RuntimeError(f"{marker} names {path}, which is not a complete checkpoint")
        return path

    def checkpoint_path(self, step: int) -> Path:
        return self.ckpt_root / f"step_{step:06d}"

    def save_checkpoint(self, step: int, write_parts: Callable[[Path], None], state: dict[str, Any],
                        barrier: Callable[[], None] = lambda: None, keep_last: int = 2) -> Path:
        """Collective: every rank calls it; `write_parts(tmp_dir)` saves actor/critic (all ranks write
        their shards), rank 0 writes trainer_state.json and commits the rename."""
        final = self.checkpoint_path(step)
        tmp = self.ckpt_root / f"{final.name}.tmp"
        if self.is_writer:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        write_parts(tmp)
        barrier()
        if self.is_writer:
            torch.save(state.pop("rng", None), tmp / "rng.pt")
            atomic_write_text(tmp / "trainer_state.json", json.dumps(state, indent=1))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            atomic_write_text(self.ckpt_root / "latest", final.name)
            for old in sorted(self.ckpt_root.glob("step_*"))[:-keep_last]:
                if old.suffix != ".tmp" and old != final:
                    shutil.rmtree(old, ignore_errors=True)
        barrier()
        return final

    @staticmethod
    def load_trainer_state(ckpt: Path) -> dict[str, Any]:
        state = json.loads((ckpt / "trainer_state.json").read_text())
        rng_file = ckpt / "rng.pt"
        if rng_file.exists():
            state["rng"] = torch.load(rng_file, weights_only=False)
        return state

    # ------------------------------------------------------------------ metrics
    def log_metrics(self, record: dict[str, Any], tensorboard: bool = True) -> None:
        if not self.is_writer:
            return
        clean = {k: _jsonable(v) for k, v in record.items()}
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(clean) + "\n")
        if tensorboard:
            tb = self._writer()
            step = int(record.get("step", 0))
            for k, v in _flatten(clean).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    tb.add_scalar(k, v, step)
            tb.flush()

    def truncate_logs(self, step: int) -> None:
        """On resume: drop log lines of steps >= `step` (written after the checkpoint, before a crash),
        so metrics.jsonl and batches.jsonl hold each step exactly once."""
        if not self.is_writer:
            return
        for name in ("metrics.jsonl", "batches.jsonl"):
            p = self.path / name
            if p.exists():
                keep = [line for line in p.read_text().splitlines() if line and json.loads(line)["step"] < step]
                atomic_write_text(p, "".join(line + "\n" for line in keep))

    def log_batch(self, step: int, trajs) -> None:
        """Audit trail: which trajectories (and prompts) each step trained on, to check that a run
        (resumed or not) never lost or repeated one."""
        if not self.is_writer:
            return
        rec = {"step": step, "traj_ids": [t.traj_id for t in trajs], "prompt_ids": [t.prompt_id for t in trajs]}
        with open(self.path / "batches.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    def _writer(self):
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.path / "tensorboard"))
        return self._tb

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def read_metrics(self) -> list[dict[str, Any]]:
        p = self.path / "metrics.jsonl"
        return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def wall_time() -> float:
    return time.time()
