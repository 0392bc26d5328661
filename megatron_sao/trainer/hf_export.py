"""Write an engine's weights as an HF model directory (the rollout engine's and users' format).

Collective: every rank takes part in the gather; rank 0 writes, streaming bucket by bucket into
safetensors shards (the weight sync's buckets: rank 0 never holds the model). The directory appears
atomically (temp dir + rename: a crash leaves no half-written export, only a temp dir that the next
start removes), with config and tokenizer files copied byte for byte from the source model.

`export_step` is the periodic export of `run.export_every`: `<run>/exports/step_N/`, the newest
`KEPT_EXPORTS` kept, as checkpoints are (checkpoints.save keeps the committed one and its fallback).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from megatron_sao.checkpoint.hf_io import HFCheckpointReader, HFCheckpointWriter, copy_extra_files
from megatron_sao.files.atomic_dir import atomic_output_dir

KEPT_EXPORTS = 2
_STEP_DIR = re.compile(r"^step_(\d+)$")


def export_hf_model(engine, src_model_dir: str | Path, out_dir: str | Path,
                    bucket_bytes: int = 256 << 20) -> Path | None:
    buckets = engine.export_hf_weights(bucket_bytes)
    if engine.ctx.rank != 0:
        for _ in buckets:  # take part in the collectives; rank 0 receives the tensors
            pass
        return None
    with atomic_output_dir(out_dir, overwrite=True) as tmp:
        writer = HFCheckpointWriter(tmp)
        for bucket in buckets:
            for name, tensor in bucket:
                writer.add(name, tensor)
        writer.close()
        copy_extra_files(HFCheckpointReader(str(src_model_dir)).extra_files(), tmp)
    return Path(out_dir)


def exported_steps(root: Path) -> dict[int, Path]:
    """{step: directory} of the complete exports under `root` (temp dirs of a killed writer excluded)."""
    if not root.is_dir():
        return {}
    return {int(m.group(1)): p for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))}


def export_step(engine, src_model_dir: str | Path, root: Path, step: int) -> Path | None:
    """Collective: the actor after `step` steps as `root/step_N`; rank 0 then removes all but the
    newest KEPT_EXPORTS exports. Returns the directory on rank 0."""
    out = export_hf_model(engine, src_model_dir, root / f"step_{step:06d}")
    if out is not None:
        steps = sorted(exported_steps(root).items())
        for _, old in steps[:-KEPT_EXPORTS]:
            shutil.rmtree(old, ignore_errors=True)
    return out


def drop_exports_after(root: Path, step: int) -> list[Path]:
    """On resume from the checkpoint of `step`: the exports of later steps belong to steps that are
    trained again, and go (the resumed run exports them anew)."""
    gone = [p for s, p in exported_steps(root).items() if s > step]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def remove_stale_exports(root: Path) -> list[Path]:
    """Temp directories of an export a killed process was writing (atomic_dir's `.step_N.tmp-*`)."""
    gone = [p for p in root.glob(".step_*.tmp-*")] if root.is_dir() else []
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone
