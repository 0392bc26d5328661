"""The critic's LR schedule spans the critic's own optimizer steps (K per trainer step, warm-up included).

The critic takes `critic_steps` (K) optimizer steps per trainer step, plus K per warm-up step. Its
cosine decay must end at the run's last critic step: sized by the trainer's step count instead, the
critic reached its minimum LR a K-th of the way through the run and trained at min_lr for the rest.
Driven through Megatron-Core's own OptimizerParamScheduler with the schedule the engine is built with.
"""

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_sao.config import load_config
from megatron_sao.trainer.components import critic_optimizer_steps, engine_optim


def _lrs(optim_cfg, steps: int) -> list[float]:
    """The LR after each of `steps` optimizer steps of an engine built with `optim_cfg`."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=optim_cfg.lr)
    sched = OptimizerParamScheduler(opt, init_lr=0.0 if optim_cfg.warmup_steps else optim_cfg.lr,
                                    max_lr=optim_cfg.lr, min_lr=optim_cfg.min_lr,
                                    lr_warmup_steps=optim_cfg.warmup_steps, lr_decay_steps=optim_cfg.decay_steps,
                                    lr_decay_style=optim_cfg.decay_style, start_wd=0.0, end_wd=0.0,
                                    wd_incr_steps=1, wd_incr_style="constant")
    out = []
    for _ in range(steps):
        sched.step(1)
        out.append(opt.param_groups[0]["lr"])
    return out


def test_the_critic_decays_over_its_own_optimizer_steps():
    cfg = load_config(None, ["run.total_steps=20", "algorithm.critic_steps=3", "algorithm.critic_warmup_steps=4",
                             "critic.optim.lr=1e-3", "critic.optim.min_lr=1e-4", "critic.optim.warmup_steps=2"])
    steps = critic_optimizer_steps(cfg)
    assert steps == (4 + 20) * 3
    lrs = _lrs(engine_optim(cfg.critic.optim, steps), steps)
    # Still well above the minimum once as many critic steps as trainer steps have run ...
    assert lrs[cfg.run.total_steps - 1] > 0.8 * cfg.critic.optim.lr
    # ... decaying all the way, and at the minimum only at the run's last critic step.
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))
    assert lrs[-2] > cfg.critic.optim.min_lr and abs(lrs[-1] - cfg.critic.optim.min_lr) < 1e-9
