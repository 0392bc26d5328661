"""The trainer's non-finite step policy: skip and log, stop with a checkpoint after N in a row."""

import pytest

from megatron_sao.config import load_config
from megatron_sao.errors import TrainingStopped
from megatron_sao.megatron.engine import StepResult
from megatron_sao.trainer.stopping import NonFiniteGuard


def test_three_nonfinite_steps_in_a_row_stop_with_a_checkpoint():
    saved = []
    limit = load_config(None, ["run.max_consecutive_nonfinite=3"]).run.max_consecutive_nonfinite
    guard = NonFiniteGuard(limit, save=lambda: saved.append(1))
    bad, good = StepResult(float("nan"), float("nan"), {}, skipped=True), StepResult(0.1, 1.0, {})
    guard.check(bad, "actor", step=7)
    guard.check(bad, "critic", step=7)  # counted per model
    guard.check(bad, "actor", step=7)
    guard.check(good, "actor", step=7)  # a good step resets the count
    assert guard.in_a_row == {"actor": 0, "critic": 1} and len(saved) == 0
    guard.check(bad, "critic", step=7)
    with pytest.raises(TrainingStopped, match="3 non-finite critic steps in a row at step 7"):
        guard.check(bad, "critic", step=7)
    assert len(saved) == 1
