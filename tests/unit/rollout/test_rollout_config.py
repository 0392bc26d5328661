"""The rollout section of the config: what the rollout tier needs agreed, refused with the key's name."""

import pytest

from megatron_sao.config import ConfigError, load_config

SERVERS = ['rollout.backend=vllm_server', 'rollout.server_urls=["http://a:8000", "http://b:8000"]']


@pytest.mark.parametrize("overrides, message", [
    ([*SERVERS, "rollout.weight_transfer_ports=[29600]", "rollout.weight_transfer_master_address=t0"],
     "rollout.weight_transfer_ports: needs one port per server"),
    ([*SERVERS, "rollout.weight_transfer_ports=[29600, 29600]", "rollout.weight_transfer_master_address=t0"],
     "must be distinct"),
    ([*SERVERS, "rollout.weight_transfer_ports=[29600, 29601]"], "rollout.weight_transfer_master_address: is required"),
    (['rollout.backend=vllm_server', 'rollout.server_urls=["http://a:8000", "http://a:8000"]'],
     "rollout.server_urls: has duplicates"),
    (["rollout.max_num_seqs=0"], "rollout.max_num_seqs: must be >= 1"),
    (["trainer.policy_lag=2", "buffer.max_staleness=2", "model.dtype=bfloat16"],
     "trainer.policy_lag: is a CPU staleness test"),
    (["trainer.policy_lag=2", "buffer.max_staleness=2", "cluster.placement=disaggregated"],
     "holds policy_lag full copies of the model"),
    (["trainer.policy_lag=1", "rollout.weight_sync_check=true"], "rollout.weight_sync_check: cannot check the lagged"),
])
def test_refused_with_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_accepted_as_the_launch_plan_writes_it():
    cfg = load_config(None, [*SERVERS, "rollout.weight_transfer_ports=[29600, 29601]",
                             "rollout.weight_transfer_master_address=t0", "rollout.max_num_seqs=4",
                             "trainer.policy_lag=1", "buffer.max_staleness=1"])
    assert cfg.rollout.weight_transfer_ports == [29600, 29601] and cfg.rollout.max_num_seqs == 4
