"""Every shipped example config loads and validates."""

from pathlib import Path

import pytest

from megatron_sao.config import load_config

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").rglob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_loads(path):
    cfg = load_config(path)
    assert cfg.buffer.batch_size >= 1


def test_math_task_loader_finds_gsm8k_from_the_example_data_dir():
    from shared_data import shared_data_dir

    from megatron_sao.envs import load_tasks

    cfg = load_config(Path(__file__).resolve().parents[2] / "examples" / "smollm2_gsm8k.yaml")
    assert cfg.env.task_kwargs["data_dir"] == "../shared/data"  # shared/ beside the checkout
    tasks = load_tasks("math_python", cfg.env.train_data, data_dir=str(shared_data_dir()))
    assert len(tasks) == 1319
