"""A built-in model's directory records which built-in (and seed) it holds, so a run folder's base_model/
is reused only for the same one: `--overwrite` with another built-in trained the old one's weights."""

from __future__ import annotations

import json

from megatron_sao.models.builtin import BUILTIN_MODELS, materialize_builtin_model


def _hidden(d) -> int:
    return json.loads((d / "config.json").read_text())["hidden_size"]


def test_base_model_of_another_builtin_is_rebuilt(tmp_path):
    out = tmp_path / "base_model"
    materialize_builtin_model("tiny_qwen3_moe_ci", out, seed=3)
    first = (out / "model.safetensors").read_bytes()
    assert materialize_builtin_model("tiny_qwen3_moe_ci", out, seed=3) == out
    assert (out / "model.safetensors").read_bytes() == first  # the same one: reused as it is
    materialize_builtin_model("tiny_qwen3_moe", out, seed=3)
    assert _hidden(out) == BUILTIN_MODELS["tiny_qwen3_moe"]["hidden_size"] != BUILTIN_MODELS["tiny_qwen3_moe_ci"][
        "hidden_size"]
    (out / "sao_builtin.json").unlink()  # written before built-ins recorded themselves: which one is unknown
    materialize_builtin_model("tiny_qwen3_moe_ci", out, seed=3)
    assert _hidden(out) == BUILTIN_MODELS["tiny_qwen3_moe_ci"]["hidden_size"]
    assert json.loads((out / "sao_builtin.json").read_text()) == {"name": "tiny_qwen3_moe_ci", "seed": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base_model"]  # no temp or stale folder left
