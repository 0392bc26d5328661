"""The paper's critic settings as one preset of overrides on a recipe (issue 35).

SAO (arXiv:2607.07508): K=2 critic optimizer steps per actor step, 10 critic-only warm-up steps, and
a critic learning rate five times the actor's (5e-6 vs 1e-6 on Qwen3-30B-A3B). A recipe sets its own
actor LR (SmolLM2: 1e-5), so the preset reads it from the config: a YAML preset cannot say "5x the
actor's", and a `preset:` in the file would sit below the recipe's own critic keys, which win.
"""

from __future__ import annotations

from benchmarks.reproduce.runner import ROOT

PAPER_WARMUP = 10
PAPER_CRITIC_STEPS = 2
PAPER_LR_RATIO = 5.0


def paper_critic(config: str, overrides: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Overrides that give `config` (with `overrides`) the paper's critic settings."""
    from megatron_sao.config import load_config

    actor_lr = load_config(ROOT / config, list(overrides)).actor.optim.lr
    return (f"algorithm.critic_warmup_steps={PAPER_WARMUP}", f"algorithm.critic_steps={PAPER_CRITIC_STEPS}",
            f"critic.optim.lr={PAPER_LR_RATIO * actor_lr:g}")
