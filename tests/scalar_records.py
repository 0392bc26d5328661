"""Read back the scalars a run logged, for the tests: TensorBoard's event files (its own reader), and
an offline W&B run (its `run-<id>.wandb` file).

The file is W&B's record log: a 7-byte header (":W&B", a magic short, a version byte), then LevelDB's
log format (32 KiB blocks of records, each a 7-byte header: crc32c, little-endian length, type
FULL/FIRST/MIDDLE/LAST) whose payloads are `wandb_internal_pb2.Record` protobufs. The installed wandb
has no reader of its own (the Go core writes the file), so this one reads the history records.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(data: bytes):
    assert data[:4] == b":W&B", "not a W&B record file"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""


def _records(run_dir: Path, kind: str):
    import wandb
    from wandb.proto import wandb_internal_pb2 as pb

    wandb.teardown()  # `finish()` returns before W&B's service has flushed the file; this waits for it

    files = sorted(Path(run_dir, "wandb").glob("offline-run-*/run-*.wandb"))
    assert files, f"no offline W&B run under {run_dir}/wandb"
    for f in files:
        for payload in _payloads(f.read_bytes()):
            rec = pb.Record()
            rec.ParseFromString(payload)
            if rec.WhichOneof("record_type") == kind:
                yield getattr(rec, kind)


def history(run_dir: Path) -> dict[int, dict[str, float]]:
    """{step: {key: value}} of every history record under `run_dir`/wandb (one offline run)."""
    out: dict[int, dict[str, float]] = {}
    for h in _records(run_dir, "history"):
        row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in h.item}
        out.setdefault(int(h.step.num), {}).update(row)
    return out


def runs(run_dir: Path) -> list[dict[str, str]]:
    """The id, display name, group and job type of each run record under `run_dir`/wandb."""
    return [{"id": r.run_id, "name": r.display_name, "group": r.run_group, "job_type": r.job_type}
            for r in _records(run_dir, "run")]


def tensorboard_scalars(path) -> dict[int, dict[str, float]]:
    """{step: {tag: value}} of the TensorBoard event files under ``path``."""
    acc = EventAccumulator(str(path))
    acc.Reload()
    out: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for ev in acc.Scalars(tag):
            out.setdefault(ev.step, {})[tag] = ev.value
    return out
