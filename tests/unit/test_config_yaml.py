"""Config YAML that would train the wrong thing, or hang, without a word: aliases (the "billion laughs"
expands to gigabytes when the config is written out), duplicate keys (YAML keeps the last block and
drops the first), an empty file (every default). Each is refused with one line naming it."""

from __future__ import annotations

import pytest

from megatron_sao.cli import main
from megatron_sao.config import ConfigError, load_config

BOMB = "a: &a ['x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x']\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)},"
    f" *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n" for i in range(8)) + "run: {name: *i}\n"


@pytest.mark.timeout(20)
def test_an_alias_bomb_is_refused_at_once(tmp_path, capsys):
    p = tmp_path / "bomb.yaml"
    p.write_text(BOMB)
    with pytest.raises(ConfigError, match=r"line 2: YAML aliases \(\*a\) are not allowed"):
        load_config(p)
    assert main(["train", str(p), f"run.dir={tmp_path / 'run'}"]) == 2  # one line, before anything is written
    assert "YAML aliases" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_merge_keys_and_aliases_in_overrides_are_refused(tmp_path):
    p = tmp_path / "merge.yaml"
    p.write_text("base: &opt {lr: 1.0e-5}\nactor:\n  optim:\n    <<: *opt\n")
    with pytest.raises(ConfigError, match="line 4: YAML aliases"):
        load_config(p)
    with pytest.raises(ConfigError, match="YAML aliases"):
        load_config(None, ["env.kwargs={a: &x [1], b: *x}"])


@pytest.mark.parametrize("text, line, first", [
    ("rollout: {concurrency: 4}\nrun: {name: x}\nrollout: {max_turns: 3}\n", 3, 1),  # drops the first block
    ("run:\n  name: a\n  seed: 1\n  name: b\n", 4, 2),
])
def test_a_duplicate_key_is_refused_naming_both_lines(tmp_path, text, line, first):
    p = tmp_path / "dup.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=f"line {line}: duplicate key .* \\(first at line {first}\\)"):
        load_config(p)


@pytest.mark.parametrize("text", ["", "# only a comment\n", "{}\n", "---\n"])
def test_an_empty_config_is_refused(tmp_path, text):
    p = tmp_path / "empty.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match="the config is empty"):
        load_config(p)


def test_anchors_without_aliases_and_plain_configs_still_load(tmp_path):
    p = tmp_path / "ok.yaml"
    p.write_text("run: &r {name: anchored}\nmodel: {path: tiny_qwen3_moe_ci}\n")
    assert load_config(p).run.name == "anchored"
