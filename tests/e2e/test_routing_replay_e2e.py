"""`sao train` with rollout routing replay and the weight check on the tiny Qwen3-MoE (HF engine: its routers'
choices are the routes)."""

import json

import pytest

from megatron_sao.trajectory import load_trajectories
from tests.e2e.e2e_util import CONFIG, sao

pytestmark = pytest.mark.slow  # runs `sao train`


def test_replay_on_trains_three_steps_with_every_route_agreeing(tmp_path):
    run = tmp_path / "r3"
    sao("train", CONFIG, f"run.dir={run}", "trainer.mode=sync", "run.total_steps=3", "algorithm.critic_warmup_steps=0",
        "rollout.routing_replay=true", "rollout.weight_sync_check=true", "rollout.weight_sync_check_atol=1e-4")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["moe/routing_agreement"] == r["moe/routing_agreement_used"] == 1.0, r
        assert r["logprob_mismatch_lag0"] < 1e-4, r
    # every push was checked, the engine scoring with its routes and the actor replaying them
    checked = [r["weight_sync/max_abs_logprob_diff"] for r in rows if "weight_sync/max_abs_logprob_diff" in r]
    assert len(checked) >= 2 and max(checked) <= 1e-4, rows
    files = sorted((run / "buffer").rglob("*.safetensors"))
    assert files, "no buffer files"
    trajs = [t for f in files for t in load_trajectories(f)]
    assert all(t.routed_experts is not None for t in trajs if t.trainable)
    for t in (t for t in trajs if t.trainable):  # [R, layers=2, topk=2], uint8 (4 experts), R <= T - 1
        assert t.routed_experts.dtype.is_floating_point is False and str(t.routed_experts.dtype) == "torch.uint8"
        assert t.routed_experts.shape[1:] == (2, 2) and t.last_action_index <= t.routed_experts.shape[0] < t.length
