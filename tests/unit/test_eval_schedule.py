"""When the trainer runs its held-out evaluation: every `run.eval_every` trainer steps and at the last,
plus the steps `run.eval_at` names (a comparison evaluates every method at the same trajectory counts)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_sao.config import ConfigError, load_config
from megatron_sao.trainer.loop import SAOTrainer

TINY = Path(__file__).resolve().parents[1] / "e2e" / "tiny_ci.yaml"


def due(overrides: list[str], total: int) -> list[int]:
    cfg = load_config(TINY, [f"run.total_steps={total}", *overrides])
    trainer = SimpleNamespace(cfg=cfg, total=total)
    return [s for s in range(1, total + 1) if SAOTrainer._eval_due(trainer, s)]


def test_eval_every_counts_trainer_steps_and_ends_with_the_last():
    assert due(["run.eval_every=4"], 10) == [4, 8, 10]
    assert due(["run.eval_every=0"], 10) == []


def test_eval_at_adds_its_steps_with_or_without_eval_every():
    assert due(["run.eval_every=0", "run.eval_at=[3,7]"], 10) == [3, 7]
    assert due(["run.eval_every=5", "run.eval_at=[3,7]"], 10) == [3, 5, 7, 10]


def test_eval_at_past_the_last_trainer_step_is_refused_naming_it():
    # tiny_ci: total_steps 2 + critic warm-up 1 = 3 trainer steps
    with pytest.raises(ConfigError, match=r"run.eval_at: names steps past the run's last trainer step 3.*\[4\]"):
        load_config(TINY, ["run.eval_at=[3,4]"])
