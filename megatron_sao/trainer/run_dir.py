"""The run directory: everything a run writes, and the only place resume reads from.

    <run>/config.yaml              resolved config snapshot (a resume with other settings keeps the
                                   previous one as config.<n>.yaml)
    <run>/metrics.jsonl            one JSON object per step (append, flushed each step)
    <run>/batches.jsonl            which trajectories and prompts each step trained on (audit trail),
                                   with their rewards, endings, positions, versions and lengths
    <run>/tensorboard/             TensorBoard event files with the same scalars
    <run>/wandb/                   W&B's files and the run's id (run.wandb.project set; scalar_sinks.py)
    <run>/exports/step_N/          HF checkpoints of the actor every run.export_every steps (two kept)
    <run>/eval/step_N.jsonl        per-item evaluation results during training
    <run>/buffer/                  finished trajectories not yet covered by the kept checkpoints
    <run>/checkpoints/             see checkpoints.py (atomic commit through `latest`, two kept)

`sao train` refuses a run directory that already holds a training run unless it is resumed
(`--resume`) or started over (`--overwrite`); what a run leaves half-written (temp files of a
killed process) is removed when the next one starts. A resume compares its config with the run's
(`resume_config_changes`): a change of what is trained, on what, or of the shapes its checkpoint
holds (`RESUME_FIXED`) is refused with the diff; any other change is logged, and the run's previous
config.yaml is kept as config.<n>.yaml.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from megatron_sao.config import SAOConfig, WandbConfig, config_text
from megatron_sao.config.strict_yaml import load_strict
from megatron_sao.errors import UserError
from megatron_sao.faults import fault_point
from megatron_sao.trainer import checkpoints as ckpts
from megatron_sao.trainer.checkpoints import atomic_write_text
from megatron_sao.trainer.hf_export import drop_exports_after, remove_stale_exports
from megatron_sao.trainer.scalar_sinks import ScalarSinks, TensorBoardSink, WandbSink, require_wandb

logger = logging.getLogger(__name__)

# What a training run writes (relative to the run directory). Earlier stages' outputs (sft_model/,
# critic_pretrained/, base_model/, sft/) are inputs of `sao train` and are never touched.
TRAIN_LOGS = ("metrics.jsonl", "batches.jsonl")
TRAIN_DIRS = ("buffer", "checkpoints", "tensorboard", "wandb", "exports", "final_model")


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def existing_training(run: Path) -> list[str]:
    """What in `run` shows that a training run already wrote there (empty for a fresh directory or
    one that only holds earlier stages' outputs)."""
    found = [name for name in TRAIN_LOGS if (run / name).exists()]
    ck = run / "checkpoints"
    if ck.is_dir() and any(p.name == ckpts.LATEST or p.name.startswith("step_") for p in ck.iterdir()):
        found.append("checkpoints/")
    if (run / "buffer").is_dir() and any((run / "buffer").rglob("*.safetensors")):
        found.append("buffer/")
    if (run / "final_model").exists():
        found.append("final_model/")
    return found


# What a resumed run may not change, as dotted config keys (a key or a section): what is trained (the
# model, its tokenizer, dtype and context, the critic's initialisation, which models the algorithm
# has), on what (the environment, its data and task settings: the checkpoint's data position indexes
# those tasks), and the shapes the checkpoint holds (which parameters train, i.e. the optimizer state).
# The parallel layout (parallel.*, the number of ranks) may change: checkpoints are Megatron distributed
# checkpoints and reshard on load (megatron/dist_state.py). Anything else (steps, learning rates, batch
# size, timeouts, ...) may change on resume and is logged.
RESUME_FIXED = ("model", "actor.init", "critic.init", "critic.freeze", "algorithm.name", "algorithm.group_size",
                "env.name", "env.train_data", "env.kwargs", "env.task_kwargs")


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def config_changes(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) of every leaf that differs; "<unset>" where one side lacks it."""
    a, b = _flat(old), _flat(new)
    return [(k, a.get(k, "<unset>"), b.get(k, "<unset>")) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)
            or (k in a) != (k in b)]


def _fixed(key: str) -> bool:
    return any(key == f or key.startswith(f + ".") for f in RESUME_FIXED)


def resume_config_changes(run: Path, cfg: SAOConfig) -> list[str]:
    """Before a resume starts (every rank; it only reads): `cfg` against the run's config.yaml. Raises
    UserError with the diff when a RESUME_FIXED key changed; returns the other changes as "key: old ->
    new" lines (to log). Nothing to compare without a config.yaml or a checkpoint (the resume then
    starts fresh)."""
    snapshot = run / "config.yaml"
    if not snapshot.is_file() or not (run / "checkpoints").is_dir() or not ckpts.candidates(run / "checkpoints"):
        return []
    try:
        old = load_strict(snapshot.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as e:
        raise UserError(f"--resume: the run's {snapshot} cannot be read ({e}); it is the record of what the run "
                        "trains, restore it or start over with --overwrite") from None
    new = load_strict(config_text(cfg))  # the same normalisation as the file (what dump_config writes)
    changes = config_changes(old if isinstance(old, dict) else {}, new)
    lines = [f"{k}: {a!r} -> {b!r}" for k, a, b in changes]
    refused = [line for (k, _, _), line in zip(changes, lines) if _fixed(k)]
    if refused:
        raise UserError(f"--resume: the config changes what {run} trains, on what, or the shapes of its checkpoint; "
                        f"a resume keeps them: {'; '.join(refused)} (start another run.dir, or --overwrite)")
    return lines


def check_run_dir(run: Path) -> None:
    """Before any stage starts: `run.dir` is a directory this process can write, or can be created
    (a file there, or a parent that is a file or read-only, is one line naming it, not a traceback
    from the first mkdir after the models are built)."""
    if run.exists():
        if not run.is_dir():
            raise UserError(f"run.dir: {run} exists and is not a directory")
        if not os.access(run, os.W_OK | os.X_OK):
            raise UserError(f"run.dir: {run} is not writable by this user")
        return
    parent = run.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"run.dir: {run} cannot be created: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"run.dir: {run} cannot be created: {parent} is not writable by this user")


def check_train_dir(run: Path, resume: bool, overwrite: bool) -> None:
    """Before anything is written: refuse to mix a new run into an old one."""
    if resume and overwrite:
        raise UserError("--resume and --overwrite exclude each other")
    found = existing_training(run)
    if found and not resume and not overwrite:
        raise UserError(f"run directory {run} already holds a training run ({', '.join(found)}); "
                        "pass --resume to continue it or --overwrite to start over")


class RunDir:
    def __init__(self, path: str | os.PathLike, is_writer: bool = True):
        self.path = Path(path)
        self.is_writer = is_writer
        self.ckpt_root = self.path / "checkpoints"
        self.buffer_dir = self.path / "buffer"
        self.exports_dir = self.path / "exports"
        if is_writer:
            self.ckpt_root.mkdir(parents=True, exist_ok=True)
        self._tb: TensorBoardSink | None = TensorBoardSink(self.path / "tensorboard")
        self.scalars = ScalarSinks([self._tb])

    # ------------------------------------------------------------------ run lifecycle
    def remove_stale(self) -> list[Path]:
        """Temp files and directories of a process that died while writing (never read by anyone)."""
        gone = ckpts.remove_uncommitted(self.ckpt_root) + remove_stale_exports(self.exports_dir)
        # Only what the trainer itself writes: other processes (a rollout server materializing the
        # base model) may be writing their own temp files into the run directory right now.
        patterns = [(self.path, f".{name}.tmp-*") for name in TRAIN_LOGS]
        patterns += [(self.path, ".final_model.tmp-*")]  # the end-of-run HF export, killed mid-write
        patterns += [(self.buffer_dir, "*.tmp-*"), (self.buffer_dir / "failed", "*.tmp-*")]
        for d, pattern in patterns:
            for p in d.glob(pattern) if d.is_dir() else ():
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
                gone.append(p)
        if gone:
            logger.info("removed %d half-written file(s) of an earlier process: %s", len(gone),
                        ", ".join(str(p.relative_to(self.path)) for p in gone[:5]) + (" ..." if len(gone) > 5 else ""))
        return gone

    def start_train(self, overwrite: bool) -> None:
        """Rank 0, before `sao train` writes anything (check_train_dir has already refused a clash)."""
        self.remove_stale()
        if overwrite:
            self.clear_training()

    def write_config(self, cfg: SAOConfig, keep_previous: bool) -> Path | None:
        """Rank 0: the run's config snapshot, atomically. `keep_previous` (a resume): a config.yaml with
        other settings is kept as config.<n>.yaml (the next free n), never overwritten; returns it."""
        p = self.path / "config.yaml"
        text, kept = config_text(cfg), None
        if keep_previous and p.is_file() and p.read_text(encoding="utf-8") != text:
            n = 1
            while (self.path / f"config.{n}.yaml").exists():
                n += 1
            kept = self.path / f"config.{n}.yaml"
            os.replace(p, kept)
        atomic_write_text(p, text)
        return kept

    def clear_training(self) -> None:
        """Delete what an earlier training run wrote (--overwrite, or --resume with no checkpoint:
        nothing covers it, and keeping it would log steps twice and train its trajectories again)."""
        self.close()
        for name in TRAIN_LOGS:
            (self.path / name).unlink(missing_ok=True)
        for name in TRAIN_DIRS:
            shutil.rmtree(self.path / name, ignore_errors=True)
        for p in (self.path / "eval").glob("step_*.jsonl"):
            p.unlink()
        self.ckpt_root.mkdir(parents=True, exist_ok=True)
        (self.buffer_dir / "failed").mkdir(parents=True, exist_ok=True)  # the buffer may already be open

    # ------------------------------------------------------------------ checkpoints
    load_trainer_state = staticmethod(ckpts.load_trainer_state)

    # ------------------------------------------------------------------ metrics
    def configure_scalars(self, tensorboard: bool, wandb: WandbConfig, name: str, config: dict[str, Any]) -> None:
        """Which sinks besides metrics.jsonl get every step's scalars (before the first step is logged)."""
        self.scalars.close()
        self._tb = TensorBoardSink(self.path / "tensorboard") if tensorboard else None
        self.scalars = ScalarSinks([self._tb] if self._tb else [])
        if wandb.project is not None and self.is_writer:
            require_wandb()
            self.scalars.add(WandbSink(wandb, self.path, name, config, group=name, job_type="train"))

    def log_metrics(self, record: dict[str, Any]) -> None:
        """One step's record: a line of metrics.jsonl, and its scalars to every sink (scalar_sinks.py)."""
        if not self.is_writer:
            return
        clean = {k: jsonable(v) for k, v in record.items()}
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(clean) + "\n")
        self.scalars.write(clean, int(record.get("step", 0)))

    def truncate_logs(self, step: int) -> None:
        """On resume from the checkpoint of `step`: drop what steps >= `step` logged (written after the
        checkpoint, before a crash), so each step appears once in metrics.jsonl, batches.jsonl,
        eval/ and TensorBoard (whose events of those steps are purged when the writer opens)."""
        if not self.is_writer:
            return
        for name in TRAIN_LOGS:
            p = self.path / name
            if p.exists():
                keep = [line for line in p.read_text().splitlines() if _complete_record_before(line, step)]
                atomic_write_text(p, "".join(line + "\n" for line in keep))
        for p in (self.path / "eval").glob("step_*.jsonl"):
            if int(p.stem.split("_")[1]) > step:  # eval/step_k is written while logging step k - 1
                p.unlink()
        drop_exports_after(self.exports_dir, step)
        if self._tb is not None:
            self._tb.purge_step = step

    def log_batch(self, step: int, trajs) -> None:
        """Audit trail: which trajectories (and prompts) each step trained on, to check that a run
        (resumed or not) never lost or repeated one; with what the run's analyses read of each
        (`episode_record`), which outlives the trajectory files (a checkpoint prunes the ones it covers
        from buffer/)."""
        if not self.is_writer:
            return
        rec = {"step": step, "traj_ids": [t.traj_id for t in trajs], "prompt_ids": [t.prompt_id for t in trajs],
               "episodes": [episode_record(t) for t in trajs]}
        with open(self.path / "batches.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        fault_point("batch_logged")

    def close(self) -> None:
        self.scalars.close()


def episode_record(t) -> dict[str, Any]:
    """What batches.jsonl keeps of a trained trajectory (benchmarks/run_failures.py, admission.py): its
    reward; how its episode ended, the environment's verdict (`env_info.reason`: correct, broken_chain,
    wrong, ...) or, for an episode the rollout cut, ``"cut: <end_reason>"``; its prompt-stream position;
    the policy version of its first action; its turns and action tokens."""
    return {"reward": jsonable(t.reward),
            "ending": t.info.get("env_info", {}).get("reason") or f"cut: {t.info.get('end_reason', 'unknown')}",
            "pos": t.info.get("data_pos"), "first_version": t.min_version(), "turns": t.num_turns,
            "action_tokens": int(t.action_mask.sum())}


def _complete_record_before(line: str, step: int) -> bool:
    """A log line to keep: a complete JSON record of a step before `step` (a kill mid-write can
    leave a partial last line, which is dropped)."""
    try:
        return json.loads(line)["step"] < step
    except (ValueError, KeyError, TypeError):
        return False


def jsonable(v: Any) -> Any:
    """`v` as strict JSON takes it: tensors as numbers or lists, and a non-finite float as its name
    ("nan", "inf"; `json.dumps` would write the non-JSON token NaN, which strict readers refuse)."""
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v

