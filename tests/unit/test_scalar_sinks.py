"""Every step's scalars reach TensorBoard and W&B (offline mode, the real package) identically, from
one fan-out in RunDir.log_metrics; a resumed run writes into the same W&B run."""

from __future__ import annotations

import math

import pytest

from megatron_sao.config import WandbConfig, load_config
from megatron_sao.config.errors import ConfigError
from megatron_sao.errors import UserError
from megatron_sao.trainer.run_dir import RunDir
from megatron_sao.trainer.scalar_sinks import flat_scalars
from tests.scalar_records import history, tensorboard_scalars


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    for k, v in {"WANDB_SILENT": "true", "WANDB_CONFIG_DIR": tmp_path / "wbcfg", "WANDB_CACHE_DIR": tmp_path / "wbc",
                 "WANDB_DATA_DIR": tmp_path / "wbd", "WANDB_DISABLE_GIT": "true"}.items():
        monkeypatch.setenv(k, str(v))


def records():
    return [{"step": s, "reward": 0.5 * s, "actor/loss": -0.1 * s, "actor/entropy": 2.0 - s,
             "lag_histogram": {"0": 8 - s, "1": s}, "buffer/ready": s, "ok": True, "note": "text",
             "nan_metric": float("nan"), "eval/accuracy": float("inf")} for s in range(3)]


def test_tensorboard_and_wandb_get_the_same_scalars(tmp_path, wandb_env):
    rd = RunDir(tmp_path)
    rd.configure_scalars(True, WandbConfig(project="sao-test", mode="offline"), "e2e", {"run": {"seed": 3}})
    for r in records():
        rd.log_metrics(r)
    rd.close()
    tb = tensorboard_scalars(tmp_path / "tensorboard")
    wb = {s: {k: v for k, v in row.items() if not k.startswith("_")} for s, row in history(tmp_path).items()}
    assert sorted(tb) == sorted(wb) == [0, 1, 2]
    for step, r in enumerate(records()):
        want = flat_scalars(r)
        assert set(want) == {"step", "reward", "actor/loss", "actor/entropy", "lag_histogram/0", "lag_histogram/1",
                             "buffer/ready"}  # bools, strings, NaN and inf stay in metrics.jsonl only
        assert set(tb[step]) == set(wb[step]) == set(want)
        for k, v in want.items():
            assert wb[step][k] == pytest.approx(v) and tb[step][k] == pytest.approx(v, abs=1e-6)
    assert math.isnan(float(__import__("json").loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
                            ["nan_metric"]))


def test_a_resumed_run_logs_into_the_same_wandb_run_and_wandb_off_writes_nothing(tmp_path, wandb_env):
    cfg = WandbConfig(project="sao-test", mode="offline")
    for steps in (range(0, 2), range(2, 4)):  # a first run, then a resumed one in the same directory
        rd = RunDir(tmp_path)
        rd.configure_scalars(False, cfg, "e2e", {})
        for s in steps:
            rd.log_metrics({"step": s, "reward": float(s)})
        rd.close()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 2 and len({p.name for p in runs}) == 1  # one run id, two sessions
    assert {s: row["reward"] for s, row in history(tmp_path).items()} == {0: 0, 1: 1, 2: 2, 3: 3}
    assert not (tmp_path / "tensorboard").exists()

    off = RunDir(tmp_path / "off")
    off.configure_scalars(True, WandbConfig(), "e2e", {})
    off.log_metrics({"step": 0, "reward": 1.0})
    off.close()
    assert not (tmp_path / "off" / "wandb").exists() and (tmp_path / "off" / "tensorboard").is_dir()


def test_wandb_config_is_typed_off_by_default_and_refuses_an_unknown_mode(tmp_path, monkeypatch):
    cfg = load_config(None, [f"run.dir={tmp_path}"])
    assert cfg.run.wandb == WandbConfig() and cfg.run.wandb.project is None
    cfg = load_config(None, ["run.wandb.project=p", "run.wandb.mode=offline", "run.wandb.entity=team"])
    assert cfg.run.wandb == WandbConfig(project="p", entity="team", mode="offline")
    with pytest.raises(ConfigError, match="run.wandb.mode"):
        load_config(None, ["run.wandb.project=p", "run.wandb.mode=cloud"])
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # as if the package were missing
    with pytest.raises(UserError, match="pip install wandb"):
        RunDir(tmp_path).configure_scalars(True, WandbConfig(project="p"), "e2e", {})
