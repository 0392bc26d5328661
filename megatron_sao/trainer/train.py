"""`sao train`: the asynchronous SAO loop (see loop.py). Run under torchrun for several ranks.

Stage wiring: when the run directory holds the outputs of the earlier stages and the config does not
say otherwise, the policy starts from `<run>/sft_model` and the critic from `<run>/critic_pretrained`.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from megatron_sao.config import SAOConfig, load_config
from megatron_sao.errors import UserError

logger = logging.getLogger(__name__)


def wire_stages(cfg: SAOConfig) -> SAOConfig:
    run = Path(cfg.run.dir)
    if cfg.actor.init is None and (run / "sft_model" / "config.json").exists():
        cfg.model.path = str(run / "sft_model")
    elif cfg.actor.init is not None:
        cfg.model.path = cfg.actor.init
    if cfg.critic.init is None and (run / "critic_pretrained" / "config.json").exists():
        cfg.critic.init = str(run / "critic_pretrained")
    return cfg


def preflight(cfg: SAOConfig, resume: bool, overwrite: bool) -> None:
    """The user errors that can be found before anything is written (every rank runs it; it only
    reads): the run directory against --resume/--overwrite, that --resume has an intact checkpoint,
    the model and init paths, the replay file."""
    from megatron_sao.models.builtin import is_builtin
    from megatron_sao.trainer.run_dir import check_run_dir, check_train_dir, resume_config_changes

    check_run_dir(Path(cfg.run.dir))
    check_train_dir(Path(cfg.run.dir), resume, overwrite)
    if resume:
        _check_some_checkpoint_is_intact(Path(cfg.run.dir) / "checkpoints")
        changed = resume_config_changes(Path(cfg.run.dir), cfg)  # the fixed keys raise, with the diff
        if changed:
            logger.warning("--resume with other settings than the run's (kept as config.<n>.yaml): %s",
                           "; ".join(changed))
    if not is_builtin(cfg.model.path) and not (Path(cfg.model.path) / "config.json").is_file():
        raise UserError(f"model.path: {cfg.model.path} is neither a built-in model nor an HF directory "
                        "with config.json")
    for key in ("actor.init", "critic.init"):
        init = getattr(getattr(cfg, key.split(".")[0]), "init")
        if init is not None and not Path(init).is_dir():
            raise UserError(f"{key}: {init} is not a directory")
    if cfg.trainer.replay:
        from megatron_sao.trajectory import TrajectoryFileError, load_trajectories

        if not Path(cfg.trainer.replay).is_file():
            raise UserError(f"trainer.replay: {cfg.trainer.replay} does not exist")
        try:
            trajs = load_trajectories(cfg.trainer.replay)
        except TrajectoryFileError as e:
            raise UserError(f"trainer.replay: {e}") from None
        needed = (cfg.run.total_steps + cfg.algorithm.warmup_steps) * cfg.buffer.batch_size
        trainable = sum(t.trainable for t in trajs)
        if trainable < needed:
            raise UserError(f"trainer.replay: {cfg.trainer.replay} holds {trainable} trainable trajectories; "
                            f"the run needs {needed} (steps incl. critic warm-up x buffer.batch_size)")


def _check_some_checkpoint_is_intact(root: Path) -> None:
    """--resume with checkpoints that are all damaged: say so now, before the trainer starts (its
    own check, per rank and with every shard, runs again when it resumes). No checkpoint at all is
    not an error: the resume then starts fresh."""
    from megatron_sao.trainer import checkpoints as ckpts

    found = ckpts.candidates(root) if root.is_dir() else []
    problems = [(c, ckpts.damage(c)) for c in found]
    if found and all(p is not None for _, p in problems):
        raise UserError(f"--resume: no intact checkpoint in {root}: "
                        + "; ".join(f"{c.name}: {p}" for c, p in problems))


def main(args) -> int:
    cfg = wire_stages(load_config(args.config, args.overrides))
    overwrite = getattr(args, "overwrite", False)
    preflight(cfg, args.resume, overwrite)
    from megatron_sao.errors import TrainingInterrupted, TrainingStopped
    from megatron_sao.trainer.loop import SAOTrainer

    trainer = SAOTrainer(cfg, resume=args.resume, overwrite=overwrite)
    try:
        trainer.run()
    except TrainingStopped as e:
        print(f"sao train: stopped: {e}", file=sys.stderr)
        return 3
    except TrainingInterrupted as e:
        print(f"sao train: {e}", file=sys.stderr)
        return 130
    return 0
