"""`sao train`: the asynchronous SAO loop (see loop.py). Run under torchrun for several ranks.

Stage wiring: when the run directory holds the outputs of the earlier stages and the config does not
say otherwise, the policy starts from `<run>/sft_model` and the critic from `<run>/critic_pretrained`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from megatron_sao.config import SAOConfig, load_config


def wire_stages(cfg: SAOConfig) -> SAOConfig:
    run = Path(cfg.run.dir)
    if cfg.actor.init is None and (run / "sft_model" / "config.json").exists():
        cfg.model.path = str(run / "sft_model")
    elif cfg.actor.init is not None:
        cfg.model.path = cfg.actor.init
    if cfg.critic.init is None and (run / "critic_pretrained" / "config.json").exists():
        cfg.critic.init = str(run / "critic_pretrained")
    return cfg


def main(args) -> int:
    from megatron_sao.trainer.loop import SAOTrainer, TrainingInterrupted, TrainingStopped

    cfg = wire_stages(load_config(args.config, args.overrides))
    trainer = SAOTrainer(cfg, resume=args.resume)
    try:
        trainer.run()
    except TrainingStopped as e:
        print(f"sao train: stopped: {e}", file=sys.stderr)
        return 3
    except TrainingInterrupted as e:
        print(f"sao train: {e}", file=sys.stderr)
        return 130
    return 0
