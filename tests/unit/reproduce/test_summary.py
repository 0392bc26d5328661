"""The reproduction suite's pure pieces: recovery time, seed statistics, run keys."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks.reproduce.runner import ROOT, Run
from benchmarks.reproduce.summary import binomial_se, first_step_started_after, mean_curve, recovery_steps, smooth, stat


def test_recovery_steps_counts_steps_until_90_percent_of_the_pre_switch_level():
    reward = [0.2, 0.8, 0.8, 0.8, 0.1, 0.3, 0.6, 0.75, 0.8, 0.8]
    level, steps = recovery_steps(reward, switch_step=4)
    assert level == pytest.approx(0.8)
    # 3-step means from step 4: 0.333, 0.55, 0.717, 0.783 (>= 0.72 at step 7 -> 3 steps after the switch)
    assert steps == 3
    assert recovery_steps([0.9, 0.9, 0.9, 0.0, 0.0, 0.1, 0.2], 3) == (pytest.approx(0.9), None)
    # Only steps before the next switch count: recovering after it is not recovering from this one.
    assert recovery_steps(reward, switch_step=4, end_step=7) == (pytest.approx(0.8), None)
    # A phase shorter than the window uses what it has.
    assert recovery_steps([0.0, 0.0, 0.5], switch_step=2, end_step=3) == (0.0, 0)
    with pytest.raises(ValueError, match="no steps before"):
        recovery_steps([0.5, 0.5], 0)


def test_stat_ignores_nan_and_formats_per_seed_values():
    s = stat([0.5, math.nan, 0.7])
    assert s.mean == pytest.approx(0.6) and s.std == pytest.approx(0.1414, abs=1e-4)
    assert "(0.500, nan, 0.700)" in s.fmt()
    assert stat([math.nan]).fmt() == "n/a"
    assert stat([0.25]).fmt() == "0.250 (one seed)"  # no "± 0.000": one seed has no spread


def test_mean_curve_and_smooth():
    x, mean, lo, hi = mean_curve([[1, 2, 3], [1, 2]], [[0.0, 1.0, 5.0], [2.0, 3.0]])
    assert x == [1, 2] and mean == [1.0, 2.0] and lo == [0.0, 1.0] and hi == [2.0, 3.0]
    assert smooth([1.0, 3.0, math.nan, 5.0], 2) == [1.0, 2.0, 3.0, 5.0]
    assert binomial_se(0.5, 100) == pytest.approx(0.05)


def test_run_key_changes_with_what_the_run_computes():
    a = Run("sao", 1, "examples/tiny_cpu.yaml", ("algorithm.critic_steps=1",))
    assert a.key() == Run("other_label", 1, "examples/tiny_cpu.yaml", ("algorithm.critic_steps=1",)).key()
    assert a.key() != Run("sao", 2, "examples/tiny_cpu.yaml", ("algorithm.critic_steps=1",)).key()
    assert a.key() != Run("sao", 1, "examples/tiny_cpu.yaml", ("algorithm.critic_steps=2",)).key()
    assert a.key() != Run("sao", 1, "examples/tiny_cpu.yaml", ("algorithm.critic_steps=1",), stage="sft").key()


def test_run_key_is_the_configs_content_not_its_comments(tmp_path):
    # A comment edited in a recipe must not orphan the hours of runs keyed by it; a value must.
    text = (ROOT / "examples/tiny_cpu.yaml").read_text()
    assert "total_steps: 50" in text  # the value changed below
    bodies = {"same.yaml": text,
              "commented.yaml": "# a new comment\n" + text.replace("total_steps: 50", "total_steps: 50  # why"),
              "changed.yaml": text.replace("total_steps: 50", "total_steps: 51")}
    for name, body in bodies.items():
        (tmp_path / name).write_text(body)
    key = {n: Run("sao", 1, str(tmp_path / n)).key() for n in ("same.yaml", "commented.yaml", "changed.yaml")}
    assert key["same.yaml"] == key["commented.yaml"] == Run("sao", 1, "examples/tiny_cpu.yaml").key()
    assert key["changed.yaml"] != key["same.yaml"]


def test_run_key_changes_with_the_algorithm_version(monkeypatch):
    # A code change that makes the same config train differently must not reuse the old runs.
    from megatron_sao.trainer import step

    a = Run("sao", 1, "examples/tiny_cpu.yaml", ("algorithm.critic_steps=1",))
    before = a.key()
    monkeypatch.setattr(step, "ALGORITHM_VERSION", step.ALGORITHM_VERSION + 1)
    assert a.key() != before
    assert a.directory(Path("w")) != Path("w") / "runs" / f"sao-s1-{before}"


def test_recovery_waits_for_batches_started_after_the_switch():
    # Async batches at steps 4 and 5 still hold episodes started before the switch at step 4.
    started_min = [0, 0, 1, 2, 3, 3, 4, 6, 7, 8]
    assert first_step_started_after(started_min, 4) == 6
    assert first_step_started_after([math.nan] * 10, 4) == 4  # not logged: the switch step itself
    reward = [0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.1, 0.2, 0.8, 0.8, 0.8]
    # From step 4 the old-style batches would count as an instant "recovery".
    assert recovery_steps(reward, 4, post_window=1) == (pytest.approx(0.8), 0)
    assert recovery_steps(reward, 4, post_window=1, search_from=6) == (pytest.approx(0.8), 4)
