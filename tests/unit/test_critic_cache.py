"""The pretrained-critic cache's key: the policy by content and every setting that changes the fit."""

import json

from megatron_sao.checkpoint.digest import dir_digest
from megatron_sao.config import load_config
from megatron_sao.trainer.critic_cache import cache_key, cache_settings, lookup, store


def _key(overrides=(), digest="a" * 64):
    return cache_key(digest, cache_settings(load_config(None, list(overrides))))


def test_the_key_changes_with_the_policy_and_with_what_the_fit_computes():
    base = _key()
    assert base == _key()  # deterministic
    assert _key(digest="b" * 64) != base
    for o in ("value_pretrain.rollouts=256", "value_pretrain.steps=7", "critic.value_head_lr=1e-3",
              "value_pretrain.value_head_lr=1e-3", "value_pretrain.lr=1e-4",
              "critic.value_head_init=normal", "critic.optim.lr=1e-4", "env.task_kwargs={max_ops: 2}",
              "algorithm.critic_lambda=0.95", "run.seed=9", "rollout.max_turns=4", "model.max_seq_len=64"):
        assert _key([o]) != base, o


def test_the_key_ignores_what_only_the_rl_run_or_the_cache_location_changes():
    base = _key()
    for o in ("run.total_steps=3", "actor.optim.lr=1e-3", "buffer.batch_size=8", "value_pretrain.cache_dir=/x",
              "run.dir=/elsewhere", "algorithm.critic_warmup_steps=1"):
        assert _key([o]) == base, o


def test_the_key_holds_the_learning_rates_the_fit_runs_at_whichever_key_set_them():
    vp_head = ["value_pretrain.value_head_lr=1e-3"]
    assert _key(vp_head) == _key(["critic.value_head_lr=1e-3"])
    assert _key(vp_head) == _key([*vp_head, "critic.value_head_lr=1e-4"])  # the RL run's head LR
    assert _key(["value_pretrain.lr=1e-4"]) == _key(["critic.optim.lr=1e-4"])
    assert _key(["value_pretrain.lr=1e-4"]) == _key(["value_pretrain.lr=1e-4", "critic.optim.lr=3e-5"])


def test_the_key_does_not_depend_on_the_settings_order():
    s = cache_settings(load_config(None))
    assert cache_key("d" * 64, s) == cache_key("d" * 64, dict(reversed(list(s.items()))))


def test_store_then_lookup_and_a_policy_rebuilt_elsewhere_hits(tmp_path):
    for d in ("a", "b"):  # the same policy bytes in two places
        (tmp_path / d).mkdir()
        (tmp_path / d / "model.safetensors").write_bytes(b"weights")
    assert dir_digest(tmp_path / "a") == dir_digest(tmp_path / "b")
    critic = tmp_path / "critic"
    critic.mkdir()
    (critic / "config.json").write_text("{}")
    key = cache_key(dir_digest(tmp_path / "a"), {"x": 1})
    assert lookup(tmp_path / "cache", key) is None
    got = store(tmp_path / "cache", key, critic, {"summary": {"ev": 0.3}})
    assert lookup(tmp_path / "cache", cache_key(dir_digest(tmp_path / "b"), {"x": 1})) == got
    assert json.loads((got.parent / "entry.json").read_text())["summary"]["ev"] == 0.3
    assert store(tmp_path / "cache", key, critic, {}) == got  # a second store of the same key is a no-op
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]  # no temp dir left
