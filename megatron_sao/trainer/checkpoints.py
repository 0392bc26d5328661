"""Training checkpoints on disk: atomic commit, verification, and the newest intact one to resume.

    <run>/checkpoints/step_000012/   actor/ critic/ (rank_NNNNN.pt each) trainer_state.json rng.pt manifest.json
    <run>/checkpoints/latest         the name of the newest committed checkpoint: THE commit point

Writing: every rank saves its shards into `step_N.tmp`; rank 0 adds the trainer state and a manifest
(every file with its size), fsyncs, renames the directory into place and then rewrites `latest`.
Only the rewrite of `latest` commits: a step directory that `latest` does not name (a kill between
the rename and the rewrite) is ignored by resume and replaced by the next save.

Two committed checkpoints are kept. Resume starts from the one `latest` names; if it is damaged
(a file missing or of the wrong size, unreadable trainer state, a torch file whose zip CRCs do not
match) the previous one is used and the log says which file was bad. The buffer keeps the files of
every trajectory that the older kept checkpoint does not cover (loop.py, save), so falling back one
checkpoint loses no data.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
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


def damage(ckpt: Path, rank_files: list[str] | None = None) -> str | None:
    """Why `ckpt` cannot be resumed from (naming the file), or None if it is intact.

    Rank 0 checks the manifest (every file present with its size) and the trainer state; each rank
    passes the torch files it will load in `rank_files` and gets their zip CRCs checked, so a
    damaged shard is found before the collective load (which would hang on the other ranks)."""
    if not ckpt.is_dir():
        return f"{ckpt.name}/ is missing"
    if rank_files is None:
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
        rank_files = ["rng.pt"]
    for rel in rank_files:
        p = ckpt / rel
        if not p.is_file():
            return f"{p} is missing"
        try:
            with zipfile.ZipFile(p) as z:
                bad = z.testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            return f"{p} is not a readable torch file ({e})"
        if bad is not None:
            return f"{p} is corrupted (CRC mismatch in {bad})"
    return None


def save(root: Path, step: int, write_parts: Callable[[Path], None], state: dict[str, Any], is_writer: bool,
         barrier: Callable[[], None] = lambda: None) -> Path | None:
    """Collective: write checkpoint `step` and commit it. Returns the previous committed checkpoint
    (kept as the fallback), or None. Older ones are deleted."""
    final = root / f"step_{step:06d}"
    tmp = root / f"{final.name}.tmp"
    # The fallback to keep: the newest committed-or-older checkpoint before this step (a resumed run
    # interrupted at once saves the step it resumed from again).
    previous = next((c for c in candidates(root) if step_of(c) < step), None) if is_writer else None
    if is_writer:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    write_parts(tmp)
    barrier()
    if is_writer:
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
    barrier()
    return previous


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


def newest_intact(root: Path, collectives, rank: int, world_size: int, roles: tuple[str, ...]) -> Path | None:
    """The checkpoint every rank resumes from (collective): the newest whose files are whole, falling
    back past damaged ones (named in the log, set aside as ``*.damaged``); None when there is none.
    Raises UserError when every checkpoint is damaged. Rank 0 checks the manifest and trainer state,
    every rank its own shards of ``roles``, and all agree on the verdict."""
    from megatron_sao.errors import UserError

    found = collectives.broadcast([str(p) for p in candidates(root)] if rank == 0 else None)
    if not found:
        return None
    damaged: list[tuple[Path, str]] = []
    for ckpt in map(Path, found):
        problem = _agreed_damage(ckpt, rank, world_size, roles)
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


def _agreed_damage(ckpt: Path, rank: int, world_size: int, roles: tuple[str, ...]) -> str | None:
    mine = [f"{role}/rank_{rank:05d}.pt" for role in roles]
    problem = (damage(ckpt) if rank == 0 else None) or damage(ckpt, rank_files=mine)
    if world_size == 1:
        return problem
    import torch.distributed as dist

    everyone = [None] * world_size
    dist.all_gather_object(everyone, problem)
    return next((p for p in everyone if p), None)
