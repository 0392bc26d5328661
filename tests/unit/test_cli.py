"""`sao --help` works for every sub-command."""

import subprocess
import sys

import pytest

from megatron_sao import cli


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_command_has_help(name):
    out = subprocess.run([sys.executable, "-m", "megatron_sao.cli", name, "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert cli.COMMANDS[name][2].split()[0] in out.stdout
