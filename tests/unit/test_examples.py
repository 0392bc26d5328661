"""Every shipped example config loads and validates."""


import pytest

from megatron_sao.config import load_config
from tests.paths import REPO

EXAMPLES = sorted((REPO / "examples").rglob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_loads(path):
    cfg = load_config(path)
    assert cfg.buffer.batch_size >= 1


def test_math_task_loader_finds_gsm8k_from_the_example_data_dir():
    from megatron_sao.envs import load_tasks
    from tests.shared_data import shared_data_dir

    cfg = load_config(REPO / "examples" / "smollm2_gsm8k.yaml")
    assert cfg.env.task_kwargs["data_dir"] == "../shared/data"  # shared/ beside the checkout
    tasks = load_tasks("math_python", cfg.env.train_data, data_dir=str(shared_data_dir()))
    assert len(tasks) == 1319
