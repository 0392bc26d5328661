"""`sao bench` refuses an option on an experiment it does not apply to, naming it, before any run."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.reproduce.__main__ import main


@pytest.mark.parametrize("argv, message", [
    (["main", "--stress"], "--stress: only with the dynamics experiment"),
    (["main", "--task", "chain"], "--task: only with main --model smollm2"),
    (["online", "--model", "smollm2", "--task", "chain"], "--task: only with main --model smollm2"),
    (["online", "--model", "smollm2", "--rows", "sao"], "--rows: only with main --model smollm2"),
    (["online", "--max-runs", "1"], "--max-runs: only with --model smollm2"),
    (["staleness", "--model", "smollm2"], "--model smollm2: only the main comparison and the online experiment"),
    (["main", "--switch-every", "20"], "--switch-every: only with the online experiment"),
    (["dynamics", "--actor-lr", "3e-6"], "--actor-lr: only with the online experiment"),
    (["online", "--actor-lr", "0"], "--actor-lr: must be positive, got 0.0"),
    (["online", "--switch-every", "-1"], "--switch-every: must be positive, got -1"),
    (["main", "--model", "smollm2", "--entropy-coef", "0.01"], "--entropy-coef: only with the online experiment"),
    (["online", "--entropy-coef", "-0.01"], "--entropy-coef: must be positive, got -0.01"),
])
def test_an_option_outside_its_experiment_is_refused(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        main([*argv, "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o")])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "w").exists() and not (tmp_path / "o").exists()


def test_the_stress_regime_changes_only_the_lag_the_lr_and_the_budget():
    from benchmarks.reproduce import dynamics
    from benchmarks.reproduce.starts import TOY_QUICK_CONFIG, Start

    start = Start("toy", TOY_QUICK_CONFIG, Path("/start"), (), 0.0)
    paper = dynamics.plan(start, dynamics.PAPER.full, [1], dynamics.PAPER)
    stress = dynamics.plan(start, dynamics.STRESS.full, [1], dynamics.STRESS)
    assert [r.label for r in paper] == list(dynamics.ROWS)
    assert [r.label for r in stress] == [*dynamics.ROWS, "sao_critic_lr4x", "sao_critic_k4"]
    for p, q in zip(paper, stress):
        changed = set(q.overrides) - set(p.overrides)
        assert changed == {"trainer.policy_lag=8", "buffer.max_staleness=8", "actor.optim.lr=0.0002",
                           "run.total_steps=100", "run.eval_every=10"}, changed
    assert not any(o.startswith("actor.optim.lr=") for o in paper[0].overrides)  # the committed runs' keys hold
    # The variant is the stress regime's SAO run with the critic's LR raised by the actor's factor.
    sao, variant = stress[0], stress[-2]
    assert set(stress[-1].overrides) - set(sao.overrides) == {"algorithm.critic_steps=4"}
    assert set(variant.overrides) - set(sao.overrides) == {"critic.optim.lr=0.0012"}
    assert set(sao.overrides) - set(variant.overrides) == set()
    from benchmarks.reproduce.starts import TOY_CONFIG
    from megatron_sao.config import load_config

    cfg = load_config(TOY_CONFIG, [])  # the config the full runs train with
    assert 0.0012 / cfg.critic.optim.lr == pytest.approx(2e-4 / cfg.actor.optim.lr) == pytest.approx(4.0)

