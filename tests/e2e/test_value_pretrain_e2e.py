"""`sao value-pretrain` fits the critic whatever `algorithm.name` the config trains with later."""

import json

import pytest

from tests.e2e.e2e_util import CONFIG, sao


@pytest.mark.slow
def test_value_pretrain_runs_for_a_non_sao_algorithm(tmp_path):
    """Regression: it read the critic's returns from the per-algorithm targets, which have none for
    GRPO or the running-mean baseline (TypeError on `fields["returns"] = None`)."""
    from megatron_sao.models.builtin import materialize_builtin_model

    policy = materialize_builtin_model("tiny_qwen3_moe_ci", tmp_path / "policy", seed=3)
    run = tmp_path / "vp"
    p = sao("value-pretrain", CONFIG, f"run.dir={run}", f"actor.init={policy}", "value_pretrain.rollouts=8",
            "value_pretrain.steps=2", "value_pretrain.batch_size=8", "algorithm.name=grpo", "algorithm.group_size=4")
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["stage"] == "value-pretrain" and summary["final_value_loss"] is not None
    assert (run / "critic_pretrained" / "config.json").exists()
    assert len((run / "value_pretrain_metrics.jsonl").read_text().splitlines()) == 2
