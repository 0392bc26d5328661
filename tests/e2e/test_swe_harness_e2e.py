"""`sao train` with the SWE environment: mini-swe-agent episodes through the agent endpoint (the real harness
over litellm, its commands in the real sandbox, the hidden tests as the reward), 2 steps with the tiny
model, and every assistant turn of every trained trajectory is what the engine sampled."""

import glob
import json
from pathlib import Path

import pytest

from megatron_sao.trajectory import load_trajectories
from tests.e2e.e2e_util import sao

pytestmark = pytest.mark.slow
CONFIG = str(Path(__file__).with_name("swe_tiny_ci.yaml"))


def test_sao_train_runs_mini_swe_agent_episodes_and_records_the_engine_s_tokens(tmp_path):
    run = tmp_path / "swe"
    sao("train", CONFIG, f"run.dir={run}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    # Sync mode: every batch at lag 0, and the learner's log-probs of the recorded tokens are the engine's
    # (a token recorded out of place, or re-tokenised, would not score like that).
    assert all(set(r["lag_histogram"]) == {"0"} for r in rows), rows
    assert all(r["logprob_mismatch_lag0"] < 1e-4 for r in rows), [r["logprob_mismatch_lag0"] for r in rows]
    turns: dict[str, list[dict]] = {}
    for line in (run / "agent_turns.jsonl").read_text().splitlines():
        rec = json.loads(line)
        turns.setdefault(rec["episode"], []).append(rec)
    trained = {t for b in (json.loads(x) for x in (run / "batches.jsonl").read_text().splitlines())
               for t in b["traj_ids"]}
    trajs = [t for f in sorted(glob.glob(str(run / "buffer" / "*.safetensors"))) for t in load_trajectories(f)]
    assert trained <= {t.traj_id for t in trajs}
    episodes: dict[str, list] = {}
    for t in trajs:
        episodes.setdefault(t.info["episode"], []).append(t)
    assert len(episodes) >= 4
    for ep, segs in episodes.items():
        segs.sort(key=lambda t: t.info["segment"])
        assert [t.info["segment"] for t in segs] == list(range(segs[0].info["segments"]))
        recorded = [t.tokens[s.start:s.end].tolist() for t in segs for s in t.spans if s.kind == "action"]
        assert recorded == [r["token_ids"] for r in turns[ep]], ep  # every assistant turn, as sampled
        lps = [x for t in segs for s in t.spans if s.kind == "action" for x in t.rollout_logprobs[s.start:s.end]]
        assert lps == pytest.approx([x for r in turns[ep] for x in r["logprobs"]], rel=1e-6)
        h = segs[-1].info["harness"]  # the real harness ran, and the environment's grader paid
        assert h["exit_status"] and h["model_calls"] == len(turns[ep]) and h["grade_error"] is None, h
        assert h["pass_to_pass"].split("/")[0] == h["pass_to_pass"].split("/")[1]  # the untouched repo passes
        assert segs[-1].reward == h["reward"] == 0.0 and segs[-1].ends_episode
