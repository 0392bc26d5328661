"""benchmarks/run_failures.py: held-out failures by episode length, and on the chain task episodes solved by
chain length."""

import json

import pytest

from benchmarks.run_failures import chain_lengths, endings, held_out_failures, report
from megatron_sao.config import load_config
from megatron_sao.config.loading import dump_config
from megatron_sao.envs.chain_python import load_chain_tasks
from megatron_sao.trainer.run_dir import episode_record
from megatron_sao.trajectory import TrajectoryBuilder, save_trajectories


def test_held_out_failures_count_failed_episodes_by_turns_and_truncation(tmp_path):
    (tmp_path / "eval").mkdir()
    rows = [{"correct": True, "turns": 4, "status": "terminated"},
            {"correct": False, "turns": 7, "status": "terminated"},
            {"correct": False, "turns": 8, "status": "truncated"},
            {"correct": False, "turns": 7, "status": "terminated"}]
    (tmp_path / "eval" / "step_000062.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval" / "step_000020.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert held_out_failures(tmp_path) == {
        "held-out at step 20": {"episodes": 1},
        "held-out at step 62": {"episodes": 4, "7 turns": 2, "8 turns, truncated": 1},
    }


def _chain_run(tmp_path, trained, evaluated, pruned=False, recorded=False):
    """A run directory on the chain task: `trained` = per step, [(train task index, reward)];
    `evaluated` = {step: [(eval task index, correct)]}. `pruned`: the trajectory files gone (a checkpoint
    covered them); `recorded`: batches.jsonl has each trajectory's episode record, as the trainer writes."""
    tmp_path.mkdir(exist_ok=True)
    dump_config(load_config("examples/tiny_cpu.yaml", [
        "env.name=chain_python", "env.train_data=train", "env.eval_data=eval", "env.task_kwargs={n: 20, seed: 0}",
        "env.eval_size=6", "algorithm.critic_warmup_steps=1"]), tmp_path / "config.yaml")
    (tmp_path / "buffer").mkdir()
    (tmp_path / "eval").mkdir()
    lines, pos = [], 0
    for step, rows in enumerate(trained):
        trajs = []
        for i, reward in rows:
            b = TrajectoryBuilder(prompt_id=f"chain/train/0/{i}@{pos}")  # the rollout appends the stream position
            b.add_prompt([1, 2])
            b.add_action([3, 4], [-0.5, -0.5], 0)
            t = b.finish("terminated", reward=reward, info={"env_info": {"reason": "correct" if reward else "wrong"}})
            if not pruned:
                save_trajectories(tmp_path / "buffer" / f"{pos:09d}-{t.traj_id}.safetensors", [t])
            trajs.append(t)
            pos += 1
        rec = {"step": step, "traj_ids": [t.traj_id for t in trajs], "prompt_ids": [t.prompt_id for t in trajs]}
        if recorded:
            rec["episodes"] = [episode_record(t) for t in trajs]
        lines.append(json.dumps(rec))
    (tmp_path / "batches.jsonl").write_text("\n".join(lines) + "\n")
    for step, rows in evaluated.items():
        (tmp_path / "eval" / f"step_{step:06d}.jsonl").write_text("".join(
            json.dumps({"prompt_id": f"chain/eval/0/{i}", "correct": ok, "turns": 4, "status": "terminated"}) + "\n"
            for i, ok in rows))
    return tmp_path


def test_chain_lengths_count_solved_episodes_by_chain_length_per_phase_and_evaluation(tmp_path):
    train = load_chain_tasks("train", n=20, seed=0)
    evals = load_chain_tasks("eval", n=6, seed=0)
    n_train = [len(train[i].meta["steps"]) for i in range(20)]
    n_eval = [len(evals[i].meta["steps"]) for i in range(6)]
    # A warm-up step, then one actor step; task 0 trained twice (solved once), task 1 once (failed).
    run = _chain_run(tmp_path, [[(0, 1.0), (1, 0.0)], [(0, 0.0)]], {5: [(0, True), (1, False), (2, True)]})
    out = chain_lengths(run, block=5)

    def expect(rows):
        c = {}
        for length, ok in rows:
            s, n = c.get(length, (0, 0))
            c[length] = (s + ok, n + 1)
        return {f"{k} steps": f"{s}/{n}" for k, (s, n) in sorted(c.items())}
    assert out == {"warm-up 0-0": expect([(n_train[0], True), (n_train[1], False)]),
                   "actor 0-4": expect([(n_train[0], False)]),
                   "held-out at step 5": expect([(n_eval[0], True), (n_eval[1], False), (n_eval[2], True)])}


def test_chain_lengths_is_empty_on_a_task_without_chains_and_names_an_unknown_prompt(tmp_path):
    run = _chain_run(tmp_path, [[(0, 1.0)]], {})
    (run / "batches.jsonl").write_text("")
    (run / "eval" / "step_000001.jsonl").write_text(json.dumps({"prompt_id": "chain/eval/0/999", "correct": True})
                                                    + "\n")
    with pytest.raises(SystemExit, match="chain/eval/0/999"):
        chain_lengths(run)
    dump_config(load_config("examples/tiny_cpu.yaml", []), run / "config.yaml")
    assert chain_lengths(run) == {}


def test_a_pruned_run_is_counted_from_what_batches_jsonl_recorded_and_an_older_one_says_what_it_lacks(tmp_path):
    """A checkpoint prunes the trajectory files it covers: the counts come from batches.jsonl's episode
    records, equal to the ones read from the files; a pruned run from before those records names the gap."""
    trained = [[(0, 1.0), (1, 0.0)], [(0, 0.0), (2, 1.0)]]
    evaluated = {5: [(0, True), (1, False)]}
    full = _chain_run(tmp_path / "files", trained, evaluated)
    kept = _chain_run(tmp_path / "recorded", trained, evaluated, pruned=True, recorded=True)
    assert not list((kept / "buffer").iterdir())
    assert chain_lengths(kept) == chain_lengths(full) and endings(kept) == endings(full)
    assert endings(kept) == {"warm-up 0-0": {"correct": 1, "wrong": 1}, "actor 0-4": {"wrong": 1, "correct": 1}}
    old = _chain_run(tmp_path / "old", trained, evaluated, pruned=True)
    with pytest.raises(SystemExit, match="pruned at a checkpoint.*--held-out-only"):
        report(old)
    assert report(old, held_out_only=True) == {**held_out_failures(full),
                                                "by chain length": {"held-out at step 5": chain_lengths(full)[
                                                    "held-out at step 5"]}}
