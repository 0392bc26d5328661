import pytest

from tests.e2e.e2e_util import CONFIG


@pytest.fixture(scope="session")
def replay_file(tmp_path_factory):
    """64 real rollouts of the random tiny model on the toy task (HF engine + agent loop)."""
    from megatron_sao.config import load_config
    from megatron_sao.models.builtin import resolve_model_dir
    from megatron_sao.trainer.value_pretrain import collect_rollouts
    from megatron_sao.trajectory import save_trajectories

    d = tmp_path_factory.mktemp("replay")
    cfg = load_config(CONFIG, [f"run.dir={d}"])
    model_dir = resolve_model_dir(cfg.model.path, d, cfg.run.seed)
    trajs = [t for t in collect_rollouts(cfg, model_dir, 64) if t.trainable]
    path = d / "rollouts.safetensors"
    save_trajectories(path, trajs)
    return path
