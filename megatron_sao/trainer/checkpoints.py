"""Training checkpoints on disk: atomic commit, verification, and the newest intact one to resume.

    <run>/checkpoints/step_000012/   actor/ critic/ (Megatron distributed checkpoints: megatron/dist_state.py)
                                     trainer_state.json rng.pt manifest.json
    <run>/checkpoints/latest         the name of the newest committed checkpoint: THE commit point

Writing: every rank writes its shards into `step_N.tmp-<id>` (a name of its own per attempt, so a writer
left over from a killed process can never write into a later attempt's directory); once every rank's
writes are done, rank 0 adds the trainer state and a manifest (every file with its size), fsyncs,
renames the directory into place and then rewrites `latest`. Only the rewrite of `latest` commits: a
step directory that `latest` does not name (a kill between the rename and the rewrite) is ignored by
resume and replaced by the next save.

Asynchronous saves (`Checkpointer`, run.async_save): the trainer is blocked only while the shards are
planned and snapshotted; writer processes write while training goes on, and the commit above runs when a
later step end (or the next save, or the run's end) finds every rank's writes finished. One checkpoint
is in flight at a time. A kill before the commit leaves the previous checkpoint as `latest`.

Two committed checkpoints are kept. Resume starts from the one `latest` names; if it is damaged
(a file missing or of the wrong size, unreadable trainer state or engine index, a torch file whose zip
CRCs do not match, or an engine checkpoint that fails to load) the previous one is used and the log
says which file was bad. The buffer keeps the files of every trajectory that the older kept checkpoint
does not cover (loop.py, save), so falling back one checkpoint loses no data.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch

from megatron_sao.faults import fault_point

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_of(ckpt: Path) -> int:
    m = _STEP_DIR.match(ckpt.name)
    if m is None:
        raise ValueError(f"{ckpt} is not a step_N checkpoint directory")
    return int(m.group(1))


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str, durable: bool = False) -> None:
    """Write `path` all-or-nothing (temp file + rename). `durable` also survives a power loss."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_path(path.parent)


def committed(root: Path) -> Path | None:
    """The checkpoint `latest` names (it may be missing or damaged: see `candidates`)."""
    marker = root / LATEST
    if not marker.is_file():
        return None
    name = marker.read_text().strip()
    return root / name if _STEP_DIR.match(name) else None


def candidates(root: Path) -> list[Path]:
    """Checkpoints to try on resume, best first: the committed one, then older complete ones.

    Directories newer than the committed one were never committed and are not candidates."""
    latest = committed(root)
    if latest is None:
        return []
    limit = step_of(latest)
    older = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir() and step_of(p) < limit]
    return [latest] + sorted(older, key=step_of, reverse=True)


def write_manifest(ckpt: Path) -> None:
    """Record every file of the checkpoint with its size (after all ranks wrote) and fsync them."""
    files = {}
    for p in sorted(ckpt.rglob("*")):
        if p.is_file():
            files[str(p.relative_to(ckpt))] = p.stat().st_size
            fsync_path(p)  # durable before the commit: a power loss must not leave a named, empty file
    for d in sorted({p.parent for p in ckpt.rglob("*")} | {ckpt}):
        fsync_path(d)
    atomic_write_text(ckpt / MANIFEST, json.dumps({"files": files}, indent=1), durable=True)


def _torch_file_problem(p: Path) -> str | None:
    if not p.is_file():
        return f"{p} is missing"
    try:
        with zipfile.ZipFile(p) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        return f"{p} is not a readable torch file ({e})"
    return f"{p} is corrupted (CRC mismatch in {bad})" if bad is not None else None


def _engine_problem(d: Path) -> str | None:
    """An engine directory: a distributed checkpoint (its index and common part whole) or, written before
    those, one torch file per rank."""
    if (d / "meta.json").is_file():  # the per-rank format (megatron/state_io.py)
        for p in sorted(d.glob("rank_*.pt")):
            problem = _torch_file_problem(p)
            if problem:
                return problem
        return None
    for name in ("metadata.json", ".metadata"):
        if not (d / name).is_file():
            return f"{d / name} is missing"
    return _torch_file_problem(d / "common.pt")


def damage(ckpt: Path) -> str | None:
    """Why `ckpt` cannot be resumed from (naming the file), or None if it looks intact: every file of the
    manifest present with its size, the trainer state readable, the torch files' zip CRCs and each
    engine's index. (Tensor data is checked by its size only; a load that fails is damage too, found by
    the load itself.)"""
    if not ckpt.is_dir():
        return f"{ckpt.name}/ is missing"
    mf = ckpt / MANIFEST
    try:
        files = json.loads(mf.read_text())["files"] if mf.exists() else {}  # {}: written before manifests
    except (ValueError, KeyError, TypeError) as e:
        return f"{mf} is unreadable ({e})"
    for rel, size in files.items():
        p = ckpt / rel
        if not p.is_file():
            return f"{p} is missing"
        if p.stat().st_size != size:
            return f"{p} has {p.stat().st_size} bytes, the manifest says {size}"
    try:
        json.loads((ckpt / "trainer_state.json").read_text())
    except (OSError, ValueError) as e:
        return f"{ckpt / 'trainer_state.json'} is unreadable ({e})"
    for problem in [_torch_file_problem(ckpt / "rng.pt")] + [_engine_problem(d) for d in sorted(ckpt.iterdir())
                                                              if d.is_dir()]:
        if problem:
            return problem
    return None


def prepare(root: Path, step: int) -> tuple[Path, Path | None]:
    """Rank 0, before a save: a fresh temp directory for checkpoint `step`, and the committed checkpoint
    to keep as the fallback (the newest before this step: a resumed run interrupted at once saves the
    step it resumed from again)."""
    previous = next((c for c in candidates(root) if step_of(c) < step), None)
    tmp = root / f"step_{step:06d}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    return tmp, previous


def commit(root: Path, step: int, tmp: Path, state: dict[str, Any], previous: Path | None) -> None:
    """Rank 0, once every rank's files are in `tmp`: trainer state, manifest, rename, `latest`, pruning."""
    final = root / f"step_{step:06d}"
    state = dict(state)
    torch.save(state.pop("rng", None), tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
    write_manifest(tmp)
    fault_point("checkpoint_parts_written")
    if final.exists():  # never committed (a kill before `latest`), or a resume that saves the same step
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_path(root)
    atomic_write_text(root / LATEST, final.name, durable=True)  # the commit
    fault_point("checkpoint_committed")
    keep = {final, previous}
    for old in root.iterdir():
        if _STEP_DIR.match(old.name) and old not in keep:
            shutil.rmtree(old, ignore_errors=True)


def save(root: Path, step: int, write_parts: Callable[[Path], None], state: dict[str, Any], is_writer: bool,
         barrier: Callable[[], None] = lambda: None) -> Path | None:
    """Collective, synchronous: write checkpoint `step` and commit it. Returns the previous committed
    checkpoint (kept as the fallback), or None. Older ones are deleted. (Single-process callers and
    tests; the trainer uses `Checkpointer`.)"""
    tmp, previous = prepare(root, step) if is_writer else (None, None)
    barrier()
    write_parts(tmp)
    barrier()
    if is_writer:
        commit(root, step, tmp, state, previous)
    barrier()
    return previous


class Checkpointer:
    """The trainer's checkpoints, one at a time, written synchronously or while training goes on.

    `save` is collective. `write_parts(tmp)` makes every engine write into `tmp` and returns the
    asynchronous requests (megatron/async_saves.py) or [] when written already. `on_commit(previous)`
    runs on every rank after the commit (rank 0 releases the buffer files the fallback covers).
    `poll` (every step end) commits a finished asynchronous checkpoint; `wait` blocks for it (the next
    save and the run's end). `gate(what)` is called before each of their collectives: the rank-0 gate."""

    def __init__(self, root: Path, *, is_writer: bool, asynchronous: bool, barrier: Callable[[], None],
                 broadcast: Callable[[Any], Any], gate: Callable[[str], None], saves=None) -> None:
        self.root, self.is_writer, self.asynchronous = root, is_writer, asynchronous
        self.barrier, self.broadcast, self.gate = barrier, broadcast, gate
        self.saves = saves
        self.last_step: int | None = None  # the step of the latest save of this process (in flight or done)
        self._metrics: dict[str, float] = {}

    def save(self, step: int, write_parts: Callable[[Path], list], state: dict[str, Any],
             on_commit: Callable[[Path | None], None]) -> float:
        """Write checkpoint `step`; returns the seconds the caller was blocked (waiting for the previous
        checkpoint not counted: that is `wait`'s)."""
        self.wait()
        t0 = time.monotonic()
        tmp, previous = prepare(self.root, step) if self.is_writer else (None, None)
        tmp, previous = self.broadcast((str(tmp), str(previous) if previous else None) if self.is_writer else None)
        tmp, previous = Path(tmp), Path(previous) if previous else None
        requests = write_parts(tmp)
        # What trainer_state.json records of this save: the seconds the trainer was blocked (for a synchronous
        # save, until every rank's shards were written) and from the start of the save to the commit.
        record = {"asynchronous": bool(requests), "blocked_s": 0.0}

        def finish() -> None:
            record["write_s"] = round(time.monotonic() - t0, 3)
            if self.is_writer:
                commit(self.root, step, tmp, {**state, "save": record}, previous)
            on_commit(previous)
            self._metrics.update({"checkpoint/write_s": record["write_s"], "checkpoint/committed_step": step})
            logger.info("checkpoint step %d committed, %.1fs after its save began (%s; the trainer was blocked "
                        "%.2fs)", step, record["write_s"], "written while training went on" if requests
                        else "written synchronously", record["blocked_s"])

        if requests:
            record["blocked_s"] = round(time.monotonic() - t0, 3)
            self.saves.schedule(requests, finish)
            fault_point("checkpoint_save_scheduled")
        else:
            self.barrier()
            record["blocked_s"] = round(time.monotonic() - t0, 3)
            finish()
            self.barrier()
        blocked = round(time.monotonic() - t0, 3)  # synchronous: the commit's fsyncs included
        self._metrics.update({"checkpoint/blocked_s": blocked, "checkpoint/step": step})
        self.last_step = step
        return blocked

    def poll(self) -> None:
        """Commit the checkpoint in flight if every rank has written it (collective; no wait)."""
        if self.saves is not None and self.saves.pending:
            self.gate("the checkpoint poll")
            self.saves.poll()

    def wait(self) -> None:
        """Block until the checkpoint in flight is written and committed (collective)."""
        if self.saves is not None and self.saves.pending:
            self.gate("the checkpoint wait")
            t0 = time.monotonic()
            self.saves.wait()
            self._metrics["checkpoint/wait_s"] = round(time.monotonic() - t0, 3)

    def abort(self) -> None:
        """Local, after an error: the checkpoint in flight is abandoned (never committed)."""
        if self.saves is not None:
            self.saves.abort()

    def take_metrics(self) -> dict[str, float]:
        """What happened to the checkpoints since the last call (for the next step's metrics record)."""
        out, self._metrics = self._metrics, {}
        return out


def load_engines(ckpt: Path, engines: dict[str, Any]) -> str | None:
    """Collective: load every engine (actor, critic) from `ckpt`; the problem, naming the engine's
    directory, when a checkpoint's contents cannot be read (dist_checkpointing fails on every rank alike:
    the ranks read the same index, and torch.distributed.checkpoint gathers the read errors of all)."""
    from megatron_sao.megatron.dist_state import UnreadableCheckpoint

    for name, engine in engines.items():
        try:
            record = engine.load(str(ckpt / name))
        except UnreadableCheckpoint as e:
            return str(e)
        saved = record.get("layout") or {k: record.get(k) for k in ("tp", "pp", "ep", "etp", "world_size")}
        logger.info("%s loaded from %s (saved at %s)", name, ckpt.name, saved)
    return None


def load_trainer_state(ckpt: Path) -> dict[str, Any]:
    state = json.loads((ckpt / "trainer_state.json").read_text())
    rng_file = ckpt / "rng.pt"
    if rng_file.exists():
        state["rng"] = torch.load(rng_file, weights_only=False)
    return state


def set_aside(root: Path, damaged: Path, used: Path) -> Path:
    """After a fallback: keep the damaged checkpoint for inspection under another name (resume and
    pruning ignore it) and make `latest` name the checkpoint that was used."""
    aside = damaged.with_name(damaged.name + ".damaged")
    shutil.rmtree(aside, ignore_errors=True)
    if damaged.exists():
        os.replace(damaged, aside)
    atomic_write_text(root / LATEST, used.name, durable=True)
    return aside


def remove_uncommitted(root: Path) -> list[Path]:
    """Half-written (`step_N.tmp`) and never-committed checkpoint directories."""
    latest = committed(root)
    gone = []
    for p in root.iterdir() if root.is_dir() else ():
        stale = p.name.endswith(".tmp") or ".tmp-" in p.name
        uncommitted = _STEP_DIR.match(p.name) and (latest is None or step_of(p) > step_of(latest))
        if stale or uncommitted:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            gone.append(p)
    return gone


def load_newest_intact(root: Path, collectives, rank: int, engines: dict[str, Any]) -> Path | None:
    """Collective: load `engines` (actor, critic) from the newest intact checkpoint and return it, falling
    back past damaged ones (named in the log, set aside as ``*.damaged``); None when there is none.
    Raises UserError when every checkpoint is damaged. Damaged: rank 0's `damage` verdict (manifest,
    trainer state, engine indexes), agreed by every rank, or an engine load that fails on the contents
    (`load_engines`)."""
    from megatron_sao.errors import UserError

    found = collectives.broadcast([str(p) for p in candidates(root)] if rank == 0 else None)
    if not found:
        return None
    damaged: list[tuple[Path, str]] = []
    for ckpt in map(Path, found):
        problem = collectives.broadcast(damage(ckpt) if rank == 0 else None) or load_engines(ckpt, engines)
        if problem is None:
            break
        logger.warning("checkpoint %s is damaged: %s", ckpt.name, problem)
        damaged.append((ckpt, problem))
    else:
        raise UserError(f"--resume: no intact checkpoint in {root}: "
                        + "; ".join(f"{c.name}: {p}" for c, p in damaged))
    if damaged:
        if rank == 0:
            for bad, _ in damaged:
                set_aside(root, bad, ckpt)
        logger.warning("resuming from %s, the newest intact checkpoint (set aside as *.damaged: %s)",
                       ckpt.name, ", ".join(bad.name for bad, _ in damaged))
        collectives.barrier()
    return ckpt
