"""The trainer's non-finite step policy: skip and log, stop with a checkpoint after N in a row."""

import pytest

from megatron_sao.config import load_config
from megatron_sao.megatron.engine import StepResult
from megatron_sao.trainer.loop import SAOTrainer, TrainingStopped


def bare_trainer(limit=3):
    t = SAOTrainer.__new__(SAOTrainer)  # the policy only needs these attributes, not a Megatron world
    t.cfg = load_config(None, [f"run.max_consecutive_nonfinite={limit}"])
    t.nonfinite, t.step, t.saved = {"actor": 0, "critic": 0}, 7, 0
    t.save = lambda: setattr(t, "saved", t.saved + 1)
    return t


def test_three_nonfinite_steps_in_a_row_stop_with_a_checkpoint():
    t = bare_trainer()
    bad, good = StepResult(float("nan"), float("nan"), {}, skipped=True), StepResult(0.1, 1.0, {})
    t._check_finite(bad, "actor")
    t._check_finite(bad, "critic")  # counted per model
    t._check_finite(bad, "actor")
    t._check_finite(good, "actor")  # a good step resets the count
    assert t.nonfinite == {"actor": 0, "critic": 1} and t.saved == 0
    t._check_finite(bad, "critic")
    with pytest.raises(TrainingStopped, match="3 non-finite critic steps in a row at step 7"):
        t._check_finite(bad, "critic")
    assert t.saved == 1
