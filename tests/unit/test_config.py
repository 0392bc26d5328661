"""Typed config: YAML + dotted overrides, presets, and errors that name the key."""

import pytest

from megatron_sao.config import ConfigError, dump_config, load_config


def test_defaults_are_the_paper_settings():
    cfg = load_config()
    a = cfg.algorithm
    assert (a.eps_low, a.eps_high, a.critic_steps, a.critic_warmup_steps) == (0.3, 5.0, 2, 10)
    assert (a.policy_alpha, a.critic_lambda, a.gamma) == (1.5, 1.0, 1.0)
    assert cfg.actor.optim.lr == 1e-6 and cfg.critic.optim.lr == 5e-6
    assert cfg.critic.freeze == ["attention", "embeddings", "router", "norms"]
    assert cfg.buffer.staleness_policy == "keep"  # every finished trajectory is trained on
    assert a.entropy_coef == 0.0  # the paper's loss has no entropy term


def test_presets_and_precedence(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("preset: coding\nalgorithm:\n  eps_high: 2.5\n")
    cfg = load_config(p, ["algorithm.critic_steps=3", "rollout.server_urls=[http://a:8000]"])
    assert cfg.algorithm.eps_low == 0.8  # from the preset
    assert cfg.algorithm.eps_high == 2.5  # the file wins over the preset
    assert cfg.algorithm.critic_steps == 3  # overrides win over the file
    assert cfg.rollout.server_urls == ["http://a:8000"]
    assert cfg.env.name == "swe"


@pytest.mark.parametrize("overrides, needle", [
    (["algorithm.foo=1"], "algorithm.foo: unknown key"),
    (["bogus=1"], "bogus: unknown key"),
    (["algorithm.eps_low=1.5"], "algorithm.eps_low: must be in"),
    (["algorithm.critic_steps=0"], "algorithm.critic_steps"),
    (["run.eval_timeout_s=0"], "run.eval_timeout_s: must be > 0"),
    (["algorithm.critic_steps=two"], "algorithm.critic_steps: expected an integer"),
    (["rollout.backend=tgi"], "rollout.backend: 'tgi' is not one of"),
    (["rollout.backend=vllm_server"], "rollout.server_urls"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel: needs parallel.tp > 1"),
    (["algorithm.name=grpo", "buffer.batch_size=12", "algorithm.group_size=8"], "buffer.batch_size"),
    (["algorithm.advantage=step_avg", "algorithm.name=running_mean"], "algorithm.advantage"),
    (["preset=physics"], "preset: unknown preset"),
    (["trainer.policy_lag=-1"], "trainer.policy_lag: must be >= 0"),
    (["trainer.policy_lag=8", "buffer.max_staleness=4", "buffer.staleness_policy=drop"],
     "buffer.max_staleness: must be >= trainer.policy_lag"),
    (["buffer.max_stale_drops=-1"], "buffer.max_stale_drops: must be >= 0"),
    (["rollout.temperature=0.7"], "rollout.temperature: must be 1.0 for algorithm.name=sao"),
    (["rollout.top_p=0.9", "algorithm.name=grpo_dis", "algorithm.group_size=2"],
     "rollout.top_p: must be 1.0 for algorithm.name=grpo_dis"),
    (["rollout.temperature=0.6", "algorithm.name=running_mean"], "rollout.temperature: must be 1.0"),
    (["rollout.temperature=0.6", "algorithm.name=grpo_rollout_ratio", "algorithm.group_size=2"],
     "rollout.temperature: must be 1.0"),
    (["run.seed=1.5"], "run.seed: expected an integer"),
    (["algorithm.eps_low"], "expected key.path=value"),
    (["parallel.etp=0"], "parallel.etp: must be >= 1"),
    (["algorithm.entropy_coef=-0.01"], "algorithm.entropy_coef: must be >= 0, got -0.01"),
    (["algorithm.entropy_coef=nan"], "algorithm.entropy_coef: must be >= 0"),
    (["rollout.weight_sync_check_every=0"], "rollout.weight_sync_check_every: must be an int >= 1"),
    (["model.dtype=float16"], "model.dtype: float16 training needs loss scaling"),
    (["rollout.start_min_servers=-1"], "rollout.start_min_servers: must be >= 0"),
    (["rollout.rejoin_attempts=0"], "rollout.rejoin_attempts: must be >= 1"),
    (["rollout.backend=vllm_server", "rollout.server_urls=[http://a:8000,http://b:8000]",
      "rollout.start_min_servers=3"], "rollout.start_min_servers: is 3 but rollout.server_urls names 2 servers"),
    (["cluster.placement=colocated", "cluster.rollout_tp=4", "rollout.backend=vllm", "rollout.routing_replay=true"],
     "rollout.routing_replay: the colocated placement cannot return routes with cluster.rollout_tp=4"),
    (["cluster.placement=colocated", "cluster.rollout_tp=2", "rollout.backend=vllm", "rollout.record_routes=true"],
     "rollout.record_routes: the colocated placement cannot return routes"),
])
def test_errors_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, overrides)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)


def test_snapshot_round_trip(tmp_path):
    cfg = load_config(None, ["preset=math", "run.name=x", "critic.freeze=[]"])
    dump_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg


def test_float_written_without_a_dot_is_a_number():
    # YAML 1.1 (pyyaml) reads `2e-4` as a string; a user writing it means a number.
    cfg = load_config(None, ["actor.optim.lr=2e-4", "critic.optim.lr=1E-3"])
    assert cfg.actor.optim.lr == 2e-4 and cfg.critic.optim.lr == 1e-3
    with pytest.raises(ConfigError, match="actor.optim.lr: expected a number, got 'fast'"):
        load_config(None, ["actor.optim.lr=fast"])


def test_sampling_settings_are_free_for_the_algorithm_that_ignores_rollout_logprobs():
    # Vanilla GRPO takes its ratio against the learner's own log-probs: the sampler's are not used.
    cfg = load_config(None, ["algorithm.name=grpo", "algorithm.group_size=2", "rollout.temperature=0.7",
                             "rollout.top_p=0.95"])
    assert (cfg.rollout.temperature, cfg.rollout.top_p) == (0.7, 0.95)
    assert not cfg.algorithm.uses_rollout_logprobs and cfg.algorithm.uses_groups
    assert load_config(None, ["algorithm.name=grpo_rollout_ratio", "algorithm.group_size=2"]).algorithm.uses_groups


@pytest.mark.parametrize("key, value", [("run.log_every", 5),
                                        ("buffer.max_pending", 64), ("trainer.global_batch_tokens", 4096)])
def test_removed_keys_still_load_with_a_warning_naming_them(tmp_path, key, value):
    """Old configs and run snapshots carry keys that were validated but never read."""
    from megatron_sao.config import RemovedConfigKey

    section, name = key.split(".")
    p = tmp_path / "old.yaml"
    p.write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.warns(RemovedConfigKey, match=rf"{key}: removed from the config schema and ignored"):
        cfg = load_config(p)
    assert not hasattr(getattr(cfg, section), name)
    with pytest.warns(RemovedConfigKey, match=key):
        load_config(None, [f"{key}={value}"])


def test_routes_stay_allowed_where_vllm_returns_them():
    """Colocated with rollout_tp 1 (one worker per engine), and disaggregated servers at any TP."""
    for placement, tp in (("colocated", 1), ("disaggregated", 4)):
        cfg = load_config(None, [f"cluster.placement={placement}", f"cluster.rollout_tp={tp}", "rollout.backend=vllm",
                                 "rollout.routing_replay=true"])
        assert cfg.rollout.routing_replay
