"""`sao sft` and `sao value-pretrain` send every step's scalars through the one fan-out
(trainer/scalar_sinks.py): TensorBoard and W&B (offline, read back from its run file) get the numbers
of the stage's metrics file, each stage its own W&B run in the experiment's group."""

import json
from pathlib import Path

import pytest

from megatron_sao.trainer.scalar_sinks import flat_scalars
from tests.e2e.e2e_util import CONFIG, sao
from tests.scalar_records import history, runs, tensorboard_scalars


def assert_same_scalars(stage_dir: Path, metrics_file: Path, steps=(0, 1)) -> None:
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(steps)
    wb, tb = history(stage_dir), tensorboard_scalars(stage_dir / "tensorboard")
    assert sorted(wb) == sorted(tb) == list(steps)
    for r in rows:
        want = flat_scalars(r)
        logged = {k: v for k, v in wb[r["step"]].items() if not k.startswith("_")}
        assert set(logged) == set(tb[r["step"]]) == set(want), (sorted(logged), sorted(want))
        for k, v in want.items():
            assert logged[k] == pytest.approx(v) and tb[r["step"]][k] == pytest.approx(v, abs=1e-6)


@pytest.mark.slow
def test_sft_and_value_pretrain_log_to_tensorboard_and_wandb(tmp_path):
    run = tmp_path / "exp"
    env = {k: str(tmp_path / k) for k in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")}
    env.update(WANDB_SILENT="true", WANDB_DISABLE_GIT="true")
    wandb = ["run.wandb.project=sao-stages", "run.wandb.mode=offline", "run.console=none"]
    sao("sft", CONFIG, f"run.dir={run}", "sft.steps=2", "sft.batch_size=8", "sft.demonstrations=32", "sft.eval=false",
        *wandb, env=env)
    sao("value-pretrain", CONFIG, f"run.dir={run}", "value_pretrain.rollouts=4", "value_pretrain.steps=2",
        "value_pretrain.batch_size=4", *wandb, env=env)
    assert_same_scalars(run / "sft", run / "sft" / "metrics.jsonl")
    assert_same_scalars(run / "value_pretrain", run / "value_pretrain" / "metrics.jsonl", steps=[0, 1, 2])
    sft, vp = runs(run / "sft"), runs(run / "value_pretrain")
    assert [(r["name"], r["group"], r["job_type"]) for r in sft] == [("e2e-sft", "e2e", "sft")]
    assert [(r["name"], r["group"], r["job_type"]) for r in vp] == [("e2e-value-pretrain", "e2e", "value-pretrain")]
    assert sft[0]["id"] != vp[0]["id"]
    assert not (run / "wandb").exists()  # `sao train`'s run (resumed across invocations) is not theirs
