"""benchmarks/run_failures.py's held-out part: failures by episode length, per evaluation file."""

import json

from benchmarks.run_failures import held_out_failures


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
