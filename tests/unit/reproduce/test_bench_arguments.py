"""`sao bench` refuses an option on an experiment it does not apply to, naming it, before any run."""

from __future__ import annotations

import pytest

from benchmarks.reproduce.__main__ import main


@pytest.mark.parametrize("argv, message", [
    (["main", "--actor-lr", "1e-4"], "--actor-lr: only with the staleness experiment"),
    (["staleness", "--actor-lr", "0"], "--actor-lr: only with the staleness experiment, and > 0"),
    (["main", "--task", "chain"], "--task: only with --model smollm2"),
    (["staleness", "--model", "smollm2"], "--model smollm2: only the main comparison"),
])
def test_an_option_outside_its_experiment_is_refused(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        main([*argv, "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o")])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "w").exists() and not (tmp_path / "o").exists()
