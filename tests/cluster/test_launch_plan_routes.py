"""The launch plan starts every `vllm serve` with --enable-return-routed-experts exactly when routes are asked for."""

import pytest

from megatron_sao.cluster.launch_plan import build_launch_plan
from tests.cluster.recipes import RECIPES

AIME = str(RECIPES / "aime_disaggregated.yaml")


@pytest.mark.parametrize("overrides, on", [((), False), (("rollout.routing_replay=true",), True),
                                           (("rollout.record_routes=true",), True)])
def test_servers_return_routes_when_replay_or_recording_is_on(overrides, on):
    plan = build_launch_plan(AIME, ["t0", "t1", "r0", "r1"], overrides=overrides, run_dir="/r", trainer_nodes=2,
                             gpus_per_node=8)
    serves = [p.argv for n in plan.nodes if n.role == "rollout" for p in n.processes]
    assert serves and all(("--enable-return-routed-experts" in a) == on for a in serves)
