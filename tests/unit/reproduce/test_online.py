"""The online experiment's recovery analysis reads committed result files as it reads live runs."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from benchmarks.reproduce import online
from benchmarks.reproduce.experiment import Settings
from benchmarks.reproduce.starts import SMOLLM2_STYLE_CONFIG, Start


def _result(reward: list[float | None], lag: int = 1) -> dict:
    """A result file's fields (run_results.summarize) for a run whose batches start `lag` steps early;
    missing values are stored as null."""
    steps = list(range(len(reward)))
    return {"steps": steps, "reward": reward,
            "series": {"rollout/policy_step_min": [None if s < lag else float(s - lag) for s in steps]}}


def test_recovery_is_counted_from_the_first_batch_started_after_the_switch():
    # Phase 1 climbs to 0.6; the switch at 10 drops it; the batch of step 10 started at step 9 (old style, still
    # high), so the search starts at 11; steps 13-15 average 0.57 >= 0.9 x 0.6: recovered 3 steps after the switch.
    up = [0.2, 0.3, 0.4, 0.5, 0.5, 0.55, 0.6, 0.6, 0.6, 0.6]
    curve = online.curve_of_result(_result([*up, 0.6, 0.1, 0.2, 0.5, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6]))
    assert math.isnan(curve.policy_step_min[0]) and curve.policy_step_min[10] == 9.0
    never = online.curve_of_result(_result([*up, 0.6, *[0.1] * 9]))
    rows, data = online.recovery_table({"sao": [curve, never]}, every=10, phases=2)
    assert data["sao"]["switches"][0]["recovery_steps"] == [3, None]
    assert data["sao"]["switches"][0]["pre_reward"] == [0.6, 0.6]
    assert rows == [["sao", "10", "0.60 ± 0.00 (0.60, 0.60)", "3, never", "3.0", "1/2"]]


def test_a_switch_from_a_reward_of_nothing_is_not_counted_as_a_recovery():
    # SmolLM2's runs: phase 1 learned (0.8), then the policy writes only the old style and earns 0.00 from the
    # first switch on. The second switch starts from 0.00: 90% of it is met at once, which is no recovery.
    up = [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.8, 0.8, 0.8, 0.8]
    collapsed = online.curve_of_result(_result([*up, *[0.0] * 20]))
    rows, data = online.recovery_table({"running_mean": [collapsed, collapsed]}, every=10, phases=3)
    assert [s["recovery_steps"] for s in data["running_mean"]["switches"]] == [[None, None], ["n/a", "n/a"]]
    assert rows[0][3:] == ["never, never", "never", "0/2"]
    assert rows[1][3:] == ["n/a, n/a", "n/a", "0/0 (2 n/a)"]


def test_on_smollm2_both_methods_take_the_same_steps_from_the_pretrained_critic():
    s = Settings("online_smollm2", False, [1, 2], 1, Path("/out"), Path("/work"), model="smollm2")
    every, phases, b = online.schedule(s)
    assert (every, phases, b.batch, b.steps, b.warmup) == (10, 3, 32, 30, 0)
    runs = online.plan(s, Start("smollm2_style", SMOLLM2_STYLE_CONFIG, Path("/start"), (), 0.0), every, b)
    assert [(r.label, r.seed) for r in runs] == [("sao", 1), ("running_mean", 1), ("sao", 2), ("running_mean", 2)]
    for r in runs:
        assert {"run.total_steps=30", "algorithm.critic_warmup_steps=0", "env.kwargs.switch_every=10",
                "critic.init=/start/critic_pretrained"} <= set(r.overrides)
    toy = Settings("online", False, [1], 1, Path("/out"), Path("/work"))
    assert online.schedule(toy)[2].warmup == 2  # the toy's critic warms up inside the budget, as before


def test_a_longer_slower_schedule_changes_only_the_phase_and_the_lrs_and_has_its_own_folder(tmp_path):
    base = Settings("online_smollm2", False, [1], 1, Path("/out"), Path("/work"), model="smollm2")
    slow = Settings("online_smollm2", False, [1], 1, Path("/out"), Path("/work"), model="smollm2",
                    switch_every=20, actor_lr=3e-6)
    start = Start("smollm2_style", SMOLLM2_STYLE_CONFIG, Path("/start"), (), 0.0)
    every, phases, b = online.schedule(slow)
    assert (every, phases, b.steps, b.warmup) == (20, 3, 60, 0)
    base_every, _, base_budget = online.schedule(base)
    before = online.plan(base, start, base_every, base_budget)
    after = online.plan(slow, start, every, b)
    for p, q in zip(before, after):
        assert set(q.overrides) - set(p.overrides) == {
            "env.kwargs.switch_every=20", "run.total_steps=60", "actor.optim.lr=3e-06", "critic.optim.lr=1.5e-05"}
    assert not any("optim.lr" in o for o in before[0].overrides)  # the committed runs' keys hold
    assert online.design_suffix(base) == "" and online.design_suffix(slow) == "_every20_lr3e-06"


def test_an_entropy_bonus_adds_only_its_coefficient_and_has_its_own_folder():
    base = Settings("online_smollm2", False, [1], 1, Path("/out"), Path("/work"), model="smollm2",
                    switch_every=20, actor_lr=5e-6)
    bonus = replace(base, entropy_coef=0.01)
    start = Start("smollm2_style", SMOLLM2_STYLE_CONFIG, Path("/start"), (), 0.0)
    every, _, b = online.schedule(bonus)
    for p, q in zip(online.plan(base, start, every, b), online.plan(bonus, start, every, b)):
        assert set(q.overrides) - set(p.overrides) == {"algorithm.entropy_coef=0.01"}
        assert set(p.overrides) <= set(q.overrides) and p.key() != q.key()
    assert online.design_suffix(bonus) == "_every20_lr5e-06_ent0.01"
    assert online.design_flags(bonus) == " --switch-every 20 --actor-lr 5e-06 --entropy-coef 0.01"
