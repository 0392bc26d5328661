"""Style-shift task: the phase schedule, the rule-based judge, the env (also built from YAML-style
kwargs), the SFT demonstrations, and the LLM judge over a local server."""

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from megatron_sao.envs import make_env
from megatron_sao.envs.base import Task
from megatron_sao.envs.style_judges import STYLES, JudgeError, OpenAICompatibleJudge, RuleBasedStyleJudge
from megatron_sao.envs.style_shift import (
    SHORT_SYSTEM_PROMPT,
    SYSTEM_PROMPT,
    StyleSchedule,
    StyleShiftEnv,
    load_style_tasks,
    make_demonstrations,
)
from megatron_sao.rollout.chat import ChatFormatter
from megatron_sao.tokenizers.char_tokenizer import build_char_tokenizer

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


def run_env(schedule, text, meta=None, env=None, task=None):
    task = task or load_style_tasks(n=1, seed=3)[0]
    if meta:
        task = Task(task.prompt_id, task.messages, task.answer, task.env, meta)

    async def main():
        e = env or StyleShiftEnv(schedule=schedule)
        await e.reset(task)
        return await e.step(text)
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


def test_env_from_yaml_kwargs_switch_every_and_styles():
    """What `env.kwargs: {switch_every: 3, styles: [...], min_hits: 1}` builds through the registry."""
    env = make_env("style_shift", switch_every=3, styles=["cute", "classical"])
    assert [env.schedule.style_at(s) for s in (0, 2, 3, 5, 6)] == ["cute", "cute", "classical", "classical", "cute"]
    r = run_env(None, SAMPLES["classical"], meta={"policy_step": 4}, env=env)
    assert r.reward == 1.0 and r.info["style"] == "classical" and r.info["phase"] == 1
    assert make_env("style_shift", switch_every=7).schedule.style_at(7) == STYLES[1]  # default styles
    assert make_env("style_shift", min_hits=3).judge.min_hits == 3
    # one cute marker: rewarded with min_hits=1 only
    one = "A bunny in the rain."
    assert run_env(None, one, env=make_env("style_shift", switch_every=5, styles=["cute"], min_hits=1)).reward == 1.0
    assert run_env(None, one, env=make_env("style_shift", switch_every=5, styles=["cute"])).reward == 0.0


@pytest.mark.parametrize("kwargs,match", [
    ({"schedule": StyleSchedule.every(4), "switch_every": 4}, "schedule or switch_every"),
    ({"styles": ["cute"]}, "styles only applies with switch_every"),
    ({"judge": RuleBasedStyleJudge(), "min_hits": 1}, "min_hits"),
    ({"switch_every": 5, "styles": ["cute", "pirate"]}, "unknown styles"),
    ({"switch_every": 5, "styles": []}, "non-empty"),
    ({"switch_every": 0}, "n_steps must be >= 1"),
])
def test_env_rejects_conflicting_or_bad_kwargs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_env("style_shift", **kwargs)


def test_tasks_without_or_with_a_short_system_prompt():
    assert [m["role"] for m in load_style_tasks(n=2, system_prompt=None)[0].messages] == ["user"]
    t = load_style_tasks(n=2, system_prompt=SHORT_SYSTEM_PROMPT)[0]
    assert t.messages[0] == {"role": "system", "content": SHORT_SYSTEM_PROMPT}


def test_demonstrations_adhere_to_exactly_one_style_and_cover_all():
    judge = RuleBasedStyleJudge(min_hits=2)
    demos = make_demonstrations(2000, seed=4)
    counts = dict.fromkeys(STYLES, 0)
    for d in demos:
        answer = d[-1]["content"]
        hits = [s for s in STYLES if judge.adheres(answer, s)]
        assert len(hits) == 1, (answer, hits)
        assert answer.isascii() and 30 <= len(answer) <= 70, answer
        counts[hits[0]] += 1
    assert all(abs(c / len(demos) - 0.25) < 0.05 for c in counts.values()), counts  # uniform over styles
    assert len({d[-1]["content"] for d in demos}) >= 30  # several templates, the topic word mixed in
    assert any(d[-1]["content"].count("piano") for d in demos)


def test_demonstrations_start_exactly_like_the_tasks_and_respect_styles():
    for sp in (SYSTEM_PROMPT, SHORT_SYSTEM_PROMPT, None):
        demos = make_demonstrations(50, seed=9, system_prompt=sp)
        tasks = load_style_tasks(50, seed=9, system_prompt=sp)
        assert [d[:-1] for d in demos] == [t.messages for t in tasks]
    judge = RuleBasedStyleJudge()
    demos = make_demonstrations(200, seed=2, styles=["chuunibyou", "classical"])
    assert {s for d in demos for s in ("chuunibyou", "classical") if judge.adheres(d[-1]["content"], s)} == {
        "chuunibyou", "classical"}
    assert not any(judge.adheres(d[-1]["content"], s) for d in demos for s in ("academic", "cute"))
    with pytest.raises(ValueError, match="unknown styles"):
        make_demonstrations(5, styles=["pirate"])


@pytest.mark.parametrize("system_prompt", [SYSTEM_PROMPT, SHORT_SYSTEM_PROMPT])
def test_demonstrations_fit_the_char_model_and_score_as_rollouts(system_prompt):
    """Encoded like SFT does (chat markup, one token per character), every demonstration fits 256
    positions; decoded back as the policy's action, the env extracts the answer and rewards it under
    its own style."""
    fmt = ChatFormatter(build_char_tokenizer())
    demos = make_demonstrations(300, seed=1, system_prompt=system_prompt)
    assert max(len(fmt.encode_demonstration(d)[0]) for d in demos) <= 256
    judge = RuleBasedStyleJudge()
    for d in demos[:40]:
        style = next(s for s in STYLES if judge.adheres(d[-1]["content"], s))
        ids, mask = fmt.encode_demonstration(d)
        action = fmt.action_text([i for i, m in zip(ids, mask) if m])
        assert action == d[-1]["content"]
        task = Task("p", d[:-1], None, "style_shift")
        r = run_env(None, action, env=StyleShiftEnv(schedule=StyleSchedule([(0, style)])), task=task)
        assert r.reward == 1.0 and r.info["reason"] == "judged"


def test_demonstrations_with_a_marker_as_topic_word_stay_in_style():
    """A custom prompt whose topic word is a marker of another style must not flip the demo's style
    (every template carries at least two markers of its own)."""
    judge = RuleBasedStyleJudge()
    for topic in ("bunny", "dragon", "evidence", "thee"):
        demos = make_demonstrations(300, seed=0, prompts=[f"Write about the {topic}"])
        assert any(topic in d[-1]["content"] for d in demos)
        for d in demos:
            assert sum(judge.adheres(d[-1]["content"], s) for s in STYLES) == 1, d[-1]["content"]


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


def test_llm_judge_from_yaml_kwargs_and_its_errors():
    from megatron_sao.envs.style_judges import OpenAICompatibleJudge
    from megatron_sao.envs.style_shift import StyleShiftEnv

    env = StyleShiftEnv(switch_every=5, judge_url="http://judge:8001/v1", judge_model="qwen", judge_api_key_env=None)
    assert isinstance(env.judge, OpenAICompatibleJudge)
    assert env.judge.url == "http://judge:8001/v1/chat/completions" and env.judge.model == "qwen"
    with pytest.raises(ValueError, match="judge_url needs judge_model"):
        StyleShiftEnv(judge_url="http://judge:8001/v1")
    with pytest.raises(ValueError, match="do not also give judge= or min_hits"):
        StyleShiftEnv(judge_url="http://judge:8001/v1", judge_model="q", min_hits=3)
