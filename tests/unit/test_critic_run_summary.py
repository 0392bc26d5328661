"""benchmarks/critic_run_summary.py reads a run directory's metrics as issue 35's result files keep them."""

import json

import pytest
import yaml

from benchmarks.critic_run_summary import main, summarize


def _run(tmp_path, evs):
    rows = [{"step": i, "reward": 0.25, "wall_time": 100.0 + 10 * i, "step_time_s": 10.0,
             "critic/explained_variance": ev, "critic/value_mean": 0.3, "critic/ev_turn_0": ev, "actor/loss": 1.0}
            for i, ev in enumerate(evs)]
    rows[-1]["eval/accuracy"] = 0.5
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"algorithm": {"critic_warmup_steps": 2},
                                                          "buffer": {"batch_size": 4}, "env": {"eval_size": 8}}))
    return tmp_path


def test_warmup_and_actor_steps_are_split_at_the_warmup_and_evals_counted_in_trajectories(tmp_path):
    s = summarize(_run(tmp_path, [0.1, 0.2, -0.3, 0.4, "nan"]))
    assert s["warmup_ev"] == [0.1, 0.2]
    assert s["actor_steps_0_9"]["ev"][:2] == [-0.3, 0.4] and s["actor_steps_0_9"]["ev_above_0"] == 1
    assert s["eval"] == {"after_20_trajectories": 0.5, "n": 8}
    assert [x["actor_step"] for x in s["steps"]] == [None, None, 0, 1, 2]
    assert "actor/loss" not in s["steps"][0] and s["steps"][0]["critic/ev_turn_0"] == 0.1
    assert s["wall_s"] == 50.0


def test_a_directory_without_metrics_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match="metrics.jsonl does not exist"):
        main([str(tmp_path), "--what", "w", "--command", "c", "--out", str(tmp_path / "o.json")])
    assert not (tmp_path / "o.json").exists()
