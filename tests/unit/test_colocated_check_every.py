"""The colocated placement honours rollout.weight_sync_check_every: the in-process load of every rank's
shard runs the log-prob check only on the versions that are multiples of N (the same rule as the
disaggregated path's WeightSync, decided by version so every rank agrees)."""

from __future__ import annotations

import types

from megatron_sao.trainer.colocated import ColocatedPlacement


class RecordingCycle:
    def __init__(self) -> None:
        self.checked: dict[int, bool] = {}

    def mark_train(self, train_s, models) -> None:
        pass

    def refresh(self, actor, models, *, version, bucket_bytes, check_tokens, atol) -> dict:
        self.checked[version] = check_tokens is not None
        return {}


def test_colocated_updates_check_only_every_nth_version():
    placement = object.__new__(ColocatedPlacement)  # the hook alone: no engine, no trainer
    placement.cfg = types.SimpleNamespace(rollout=types.SimpleNamespace(weight_sync_check_every=3))
    placement.cycle, placement.actor, placement.models = RecordingCycle(), object(), []
    placement.bucket_bytes, placement.atol, placement.check_tokens = 1 << 20, 1e-3, [5, 6, 7]
    for version in range(1, 7):
        assert "time/weight_sync_s" in placement.after_train(version, 0.1)
    assert placement.cycle.checked == {1: False, 2: False, 3: True, 4: False, 5: False, 6: True}

    placement.check_tokens = None  # rollout.weight_sync_check off: never checked
    placement.after_train(9, 0.1)
    assert placement.cycle.checked[9] is False
