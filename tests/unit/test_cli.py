"""`sao --help` works for every sub-command; unbuilt commands say so and exit 2."""

import subprocess
import sys

import pytest

from megatron_sao import cli


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_command_has_help(name):
    out = subprocess.run([sys.executable, "-m", "megatron_sao.cli", name, "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert cli.COMMANDS[name][2].split()[0] in out.stdout


def test_unbuilt_command_exits_2(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "train", ("megatron_sao.trainer.not_there", "main", "x"))
    assert cli.main(["train", "cfg.yaml"]) == 2
    assert "not built yet" in capsys.readouterr().err
