"""`sao train --resume` with another config: a change of what the run trains, on what, or of its
checkpoint's shapes is refused with the diff; another change (batch size, steps, ...) is logged, and the
run's previous config.yaml is kept as config.<n>.yaml, never overwritten (it was, and the run's old
model trained under the new settings)."""

from __future__ import annotations

import pytest
import torch

from megatron_sao.config import config_text, load_config
from megatron_sao.errors import UserError
from megatron_sao.trainer import checkpoints as C
from megatron_sao.trainer.run_dir import RunDir, config_changes, resume_config_changes


def _run(tmp_path, *overrides):
    """A run folder as a run leaves it: its config.yaml and a committed checkpoint."""
    cfg = load_config(None, [f"run.dir={tmp_path}", *overrides])
    RunDir(tmp_path).write_config(cfg, keep_previous=False)

    def parts(d):
        (d / "actor").mkdir()
        torch.save({"w": torch.zeros(4)}, d / "actor" / "rank_00000.pt")
    C.save(tmp_path / "checkpoints", 3, parts, {"step": 3}, is_writer=True)
    return cfg


@pytest.mark.parametrize("override, needle", [
    ("model.path=tiny_qwen3_moe_ci", "model.path: 'tiny_qwen3_moe' -> 'tiny_qwen3_moe_ci'"),
    ("env.name=math_python", "env.name: 'toy_tool' -> 'math_python'"),
    ("env.task_kwargs.max_ops=5", "env.task_kwargs.max_ops: '<unset>' -> 5"),
    ("model.max_seq_len=512", "model.max_seq_len: 256 -> 512"),
    ("critic.freeze=[]", "critic.freeze: ['attention', 'embeddings', 'router', 'norms'] -> []"),
])
def test_a_change_of_model_environment_or_shapes_is_refused_with_the_diff(tmp_path, override, needle):
    _run(tmp_path)
    before = (tmp_path / "config.yaml").read_text()
    with pytest.raises(UserError, match="--resume: the config changes what") as err:
        resume_config_changes(tmp_path, load_config(None, [f"run.dir={tmp_path}", override]))
    assert needle in str(err.value), str(err.value)
    assert (tmp_path / "config.yaml").read_text() == before and not list(tmp_path.glob("config.*.yaml"))


def test_other_changes_are_logged_and_the_previous_config_is_kept(tmp_path):
    old = _run(tmp_path)
    # parallel.*: the checkpoint reshards to the new layout (tests/integration/megatron/test_dist_checkpoint.py)
    new = load_config(None, [f"run.dir={tmp_path}", "buffer.batch_size=64", "run.total_steps=300", "parallel.tp=2"])
    assert resume_config_changes(tmp_path, new) == ["buffer.batch_size: 128 -> 64", "parallel.tp: 1 -> 2",
                                                    "run.total_steps: 100 -> 300"]
    rd = RunDir(tmp_path)
    assert rd.write_config(new, keep_previous=True) == tmp_path / "config.1.yaml"
    assert (tmp_path / "config.1.yaml").read_text() == config_text(old)
    assert (tmp_path / "config.yaml").read_text() == config_text(new)
    assert rd.write_config(new, keep_previous=True) is None  # the same settings again: nothing to keep
    third = load_config(None, [f"run.dir={tmp_path}", "buffer.batch_size=32"])
    assert rd.write_config(third, keep_previous=True) == tmp_path / "config.2.yaml"
    assert (tmp_path / "config.1.yaml").read_text() == config_text(old)  # never overwritten


def test_nothing_to_compare_without_a_checkpoint(tmp_path):
    """A resume with no checkpoint starts fresh: nothing of the old settings is in use."""
    load_config(None, [f"run.dir={tmp_path}"])
    RunDir(tmp_path).write_config(load_config(None, [f"run.dir={tmp_path}"]), keep_previous=False)
    assert resume_config_changes(tmp_path, load_config(None, [f"run.dir={tmp_path}", "env.name=coding"])) == []


def test_config_changes_flattens_sections():
    assert config_changes({"a": {"b": 1, "c": [1]}, "d": {}}, {"a": {"b": 2, "c": [1]}, "d": {"e": 3}}) == [
        ("a.b", 1, 2), ("d", {}, "<unset>"), ("d.e", "<unset>", 3)]
