"""benchmarks/admission.py reads which prompt-stream positions, at which policy lag, each step trained on."""

import json

import pytest

from benchmarks.admission import composition
from megatron_sao.config import load_config
from megatron_sao.config.loading import dump_config
from megatron_sao.trainer.run_dir import episode_record
from megatron_sao.trajectory import TrajectoryBuilder, save_trajectories

B, WARMUP = 2, 1


def _run(tmp_path, mode, batches, untrained=(), pruned=False):
    """A run directory: `batches` = per step, [(position, version of its actions, action tokens)];
    `untrained`: more such episodes in the buffer that no step consumed. `pruned`: the trained ones' files
    gone (a checkpoint covered them), their episode records in batches.jsonl as the trainer writes them."""
    tmp_path.mkdir(exist_ok=True)
    dump_config(load_config("examples/tiny_cpu.yaml", [f"buffer.batch_size={B}", f"trainer.mode={mode}",
                                                       f"algorithm.critic_warmup_steps={WARMUP}"]),
                tmp_path / "config.yaml")
    (tmp_path / "buffer").mkdir()
    lines, seq = [], 0
    for step, rows in enumerate([*batches, list(untrained)]):
        trajs = []
        for pos, version, n in rows:
            b = TrajectoryBuilder(prompt_id=f"p{pos}")
            b.add_prompt([1, 2])
            b.add_action(list(range(3, 3 + n)), [-0.5] * n, version)
            t = b.finish("terminated", reward=float(pos % 2))
            t.info.update(data_pos=pos, sample=0)
            if not pruned or step == len(batches):
                save_trajectories(tmp_path / "buffer" / f"{seq:09d}-{t.traj_id}.safetensors", [t])
            trajs.append(t)
            seq += 1
        rec = {"step": step, "traj_ids": [t.traj_id for t in trajs]}
        if pruned:
            rec["episodes"] = [episode_record(t) for t in trajs]
        lines.append(json.dumps(rec))
    (tmp_path / "batches.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    return tmp_path


def test_a_synchronous_run_trains_each_block_at_lag_0(tmp_path):
    c = composition(_run(tmp_path, "sync", [[(0, 0, 4), (1, 0, 4)], [(2, 0, 4), (3, 0, 4)], [(4, 1, 4), (5, 1, 4)]]),
                    block=5)
    assert c["mode"] == "sync"
    actor = c["phases"]["actor 0-4"]
    assert actor["trajectories"] == 4 and actor["lag"] == 0.0 and actor["displaced"] == 0.0
    assert c["not_trained"]["trajectories"] == 0


def test_an_overtaking_short_episode_is_displaced_and_a_stale_one_lags(tmp_path):
    # Step 2 (actor version 1) trains position 6, a short episode of block 3, and position 3 (block 1) at
    # version 0; position 5 finished but was never trained.
    c = composition(_run(tmp_path, "async", [[(0, 0, 4), (1, 0, 4)], [(2, 0, 4), (4, 0, 2)], [(3, 0, 8), (6, 1, 2)]],
                         untrained=[(5, 1, 6)]), block=5)
    actor = c["phases"]["actor 0-4"]
    assert actor["trajectories"] == 4
    assert actor["displaced"] == pytest.approx(0.75)  # positions 4, 3 and 6 lie outside their step's block
    assert actor["displaced_action_tokens"] == pytest.approx(4.0) and actor["in_block_action_tokens"] == 4.0
    assert actor["lag"] == pytest.approx(0.25) and actor["lag_share"] == 0.25  # position 3 at step 2
    assert c["phases"]["warm-up 0-0"]["lag"] == 0.0
    assert c["not_trained"] == {"trajectories": 1, "reward": 1.0, "action_tokens": 6.0}


def test_a_checkpointed_run_reads_the_same_from_batches_jsonl_and_an_older_one_names_the_gap(tmp_path):
    steps = [[(0, 0, 4), (1, 0, 4)], [(2, 0, 4), (4, 0, 2)], [(3, 0, 8), (6, 1, 2)]]
    files = composition(_run(tmp_path / "files", "async", steps, untrained=[(5, 1, 6)]), block=5)
    pruned = _run(tmp_path / "pruned", "async", steps, untrained=[(5, 1, 6)], pruned=True)
    assert len(list((pruned / "buffer").glob("*.safetensors"))) == 1  # only the untrained episode
    assert composition(pruned, block=5) == files
    lines = (pruned / "batches.jsonl").read_text().splitlines()
    (pruned / "batches.jsonl").write_text("".join(json.dumps({k: v for k, v in json.loads(line).items()
                                                              if k != "episodes"}) + "\n" for line in lines))
    with pytest.raises(SystemExit, match="step 0 trained 2 trajectories not in buffer/.*pruned at a checkpoint"):
        composition(pruned)


def test_a_non_sao_run_is_refused_by_name(tmp_path):
    run = _run(tmp_path, "async", [[(0, 0, 4), (1, 0, 4)]])
    dump_config(load_config("examples/tiny_cpu.yaml", ["algorithm.name=grpo"]), run / "config.yaml")
    with pytest.raises(SystemExit, match="algorithm grpo"):
        composition(run)
