"""`sao value-pretrain` fits the critic whatever `algorithm.name` the config trains with later, scores
it on held-out rollouts, and a second invocation with the same policy and settings takes the cached critic."""

import json

import pytest

from tests.e2e.e2e_util import CONFIG, sao


@pytest.mark.slow
def test_value_pretrain_holds_out_rollouts_and_caches_the_critic(tmp_path):
    """Regression: it read the critic's returns from the per-algorithm targets, which have none for
    GRPO or the running-mean baseline (TypeError on `fields["returns"] = None`)."""
    from megatron_sao.models.builtin import materialize_builtin_model

    policy = materialize_builtin_model("tiny_qwen3_moe_ci", tmp_path / "policy", seed=3)
    run, cache = tmp_path / "vp", tmp_path / "cache"
    common = [f"actor.init={policy}", "value_pretrain.rollouts=8", "value_pretrain.steps=2",
              "value_pretrain.batch_size=8", "algorithm.name=grpo", "algorithm.group_size=4",
              f"value_pretrain.cache_dir={cache}"]
    p = sao("value-pretrain", CONFIG, f"run.dir={run}", *common)
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["stage"] == "value-pretrain" and summary["final_value_loss"] is not None
    assert summary["heldout_trajectories"] >= 1
    assert summary["train_trajectories"] + summary["heldout_trajectories"] == summary["usable"]
    assert summary["rollout_s"] > 0 and summary["fit_s"] > 0 and "load1_start" in summary  # what it cost
    assert summary["ceiling"] is not None  # toy_tool knows its solutions: the oracle's EV on the held-out split
    assert (run / "critic_pretrained" / "config.json").exists()
    rows = [json.loads(line) for line in (run / "value_pretrain" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # the fresh critic, then after each step
    for r in rows:
        assert {"heldout/explained_variance", "heldout/value_mean", "heldout/return_mean",
                "heldout/value_loss"} <= set(r)
    assert all("train/value_loss" in r and "train/grad_norm/value_head" in r for r in rows[1:])

    again = sao("value-pretrain", CONFIG, f"run.dir={tmp_path / 'vp2'}", *common)
    cached = json.loads(again.stdout.strip().splitlines()[-1])
    assert cached["cached"] is True and cached["cache_key"] == summary["cache_key"]
    assert not (tmp_path / "vp2" / "value_pretrain_rollouts.safetensors").exists()  # no rollouts played
    for f in (run / "critic_pretrained").iterdir():
        assert (tmp_path / "vp2" / "critic_pretrained" / f.name).read_bytes() == f.read_bytes()
