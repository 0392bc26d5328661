"""Style-shift task: the phase schedule, the rule-based judge, the env, and the LLM judge over a local server."""

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from megatron_sao.envs.base import Task
from megatron_sao.envs.style_judges import JudgeError, OpenAICompatibleJudge, RuleBasedStyleJudge
from megatron_sao.envs.style_shift import StyleSchedule, StyleShiftEnv, load_style_tasks

SAMPLES = {
    "academic": "Furthermore, the evidence suggests that rain shapes the town; in conclusion, analysis matters.",
    "cute": "Hehe~ the fluffy bunny hops in the rain, yay! <3",
    "chuunibyou": "My sealed right eye throbs; the dark flame of destiny awakens from the abyss!",
    "classical": "Alas, thou art weary, and the rain hath o'er the town doth fall; 'tis night.",
}


def test_schedule_from_phases():
    s = StyleSchedule([(0, "academic"), (10, "cute"), (25, "classical")])
    assert [s.style_at(i) for i in (0, 9, 10, 24, 25, 1000)] == [
        "academic", "academic", "cute", "cute", "classical", "classical"]
    assert s.phase_at(24) == 1


def test_schedule_every_n_cycles():
    s = StyleSchedule.every(5)
    assert [s.style_at(i) for i in range(0, 45, 5)] == [
        "academic", "cute", "chuunibyou", "classical", "academic", "cute", "chuunibyou", "classical", "academic"]
    assert s.phase_at(44) == 8


@pytest.mark.parametrize("phases,match", [([], "at least one"), ([(5, "cute")], "start at step 0"),
                                          ([(0, "cute"), (0, "academic")], "strictly increasing"),
                                          ([(0, "pirate")], "unknown style")])
def test_schedule_rejects_bad_phases(phases, match):
    with pytest.raises(ValueError, match=match):
        StyleSchedule(phases)


def test_schedule_advance_is_monotone():
    s = StyleSchedule.every(3)
    s.advance(4)
    assert s.current_step == 4
    with pytest.raises(ValueError, match="cannot go back"):
        s.advance(2)


def test_rule_judge_matches_only_its_style():
    judge = RuleBasedStyleJudge()
    for text_style, text in SAMPLES.items():
        for style in SAMPLES:
            assert judge.adheres(text, style) == (style == text_style), (text_style, style)
    assert not judge.adheres("A plain sentence about rain.", "academic")
    # markers of two styles in equal number: neither wins
    assert not judge.adheres(SAMPLES["cute"] + " " + SAMPLES["classical"], "cute")


def run_env(schedule, text, meta=None):
    task = load_style_tasks(n=1, seed=3)[0]
    if meta:
        task = Task(task.prompt_id, task.messages, task.answer, task.env, meta)

    async def main():
        env = StyleShiftEnv(schedule=schedule)
        await env.reset(task)
        return await env.step(text)
    return asyncio.run(main())


def test_env_reward_follows_the_phase():
    sched = StyleSchedule.every(10)
    r = run_env(sched, SAMPLES["academic"])
    assert r.done and r.reward == 1.0 and r.info["style"] == "academic"
    sched.advance(12)  # the trainer moved into the "cute" phase
    assert run_env(sched, SAMPLES["academic"]).reward == 0.0
    assert run_env(sched, SAMPLES["cute"]).reward == 1.0
    # a policy_step stamped on the task wins over the shared schedule
    r = run_env(sched, SAMPLES["classical"], meta={"policy_step": 35})
    assert r.reward == 1.0 and r.info["phase"] == 3
    assert run_env(sched, "   ").info["reason"] == "empty_response"


class _FakeJudge(BaseHTTPRequestHandler):
    reply = "YES"
    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _FakeJudge.seen.append((self.headers.get("Authorization"), body))
        out = json.dumps({"choices": [{"message": {"content": _FakeJudge.reply}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture
def judge_server():
    server = HTTPServer(("127.0.0.1", 0), _FakeJudge)
    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{server.server_port}/v1"
    server.shutdown()
    server.server_close()


def test_openai_judge_against_local_server(judge_server, monkeypatch):
    monkeypatch.setenv("SAO_TEST_JUDGE_KEY", "k123")
    judge = OpenAICompatibleJudge(judge_server, model="judge-model", api_key_env="SAO_TEST_JUDGE_KEY", timeout_s=5)
    _FakeJudge.seen.clear()
    _FakeJudge.reply = "YES."
    assert asyncio.run(judge.judge("Describe rain.", "Hehe~ rain!", "cute")) is True
    _FakeJudge.reply = "no"
    assert asyncio.run(judge.judge("Describe rain.", "Rain falls.", "cute")) is False
    auth, body = _FakeJudge.seen[0]
    assert auth == "Bearer k123" and body["model"] == "judge-model"
    assert "YES or NO" in body["messages"][0]["content"] and "cute" in body["messages"][0]["content"]
    _FakeJudge.reply = "Maybe"
    with pytest.raises(JudgeError, match="expected YES or NO"):
        asyncio.run(judge.judge("p", "r", "cute"))


def test_openai_judge_errors_are_clear(monkeypatch):
    monkeypatch.delenv("SAO_TEST_MISSING_KEY", raising=False)
    with pytest.raises(JudgeError, match="SAO_TEST_MISSING_KEY is not set"):
        asyncio.run(OpenAICompatibleJudge("http://127.0.0.1:9", "m", "SAO_TEST_MISSING_KEY").judge("p", "r", "cute"))
    with pytest.raises(JudgeError, match="unreachable"):  # port 9 (discard) on localhost: refused
        asyncio.run(OpenAICompatibleJudge("http://127.0.0.1:9", "m", None, timeout_s=2).judge("p", "r", "cute"))
    with pytest.raises(ValueError, match="http"):
        OpenAICompatibleJudge("127.0.0.1:9", "m")
