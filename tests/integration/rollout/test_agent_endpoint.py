"""The agent endpoint over HTTP, driven by the plain `openai` client: exact tokens against a real engine,
the rewritten-history rule, limits, errors, streaming, and an episode whose engine dies."""

from __future__ import annotations

import asyncio
import json
import threading

import openai
import pytest

from megatron_sao.envs.base import HarnessOutcome
from megatron_sao.rollout.agent_endpoint.episode import run_harness_episode
from megatron_sao.rollout.agent_endpoint.server import AgentEndpoint
from megatron_sao.rollout.chat import ChatFormatter
from megatron_sao.rollout.engines.protocol import SamplingParams
from megatron_sao.rollout.turns import AgentLoopConfig
from megatron_sao.tokenizers import build_char_tokenizer
from tests.agent_endpoint_fixtures import BASH_TOOL, LoopThread, RecordingEngine, ScriptedTextEngine

TOK = build_char_tokenizer()
F = ChatFormatter(TOK)
STOP = F.stop_token_ids[-1]  # <|end|>
CALL = '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'


def cfg(**kw) -> AgentLoopConfig:
    base = dict(max_turns=8, max_total_tokens=4000, max_new_tokens_per_turn=128, sampling=SamplingParams(128))
    return AgentLoopConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def served():
    lt = LoopThread()
    ep = AgentEndpoint(F)
    lt.run(ep.start())
    yield lt, ep
    lt.run(ep.stop())
    lt.close()


def client(ep, session) -> openai.OpenAI:
    me = ep.model_endpoint(session)
    return openai.OpenAI(base_url=me.base_url, api_key=me.api_key, max_retries=0)


def spans_of(traj, kind):
    return [traj.tokens[s.start:s.end].tolist() for s in traj.spans if s.kind == kind]


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from megatron_sao.models.builtin import materialize_builtin_model
    from megatron_sao.rollout.engines.factory import make_engine
    from megatron_sao.rollout.engines.protocol import EngineConfig

    d = materialize_builtin_model("tiny_qwen3_moe_ci", tmp_path_factory.mktemp("tiny"), seed=0)
    return make_engine(EngineConfig(backend="hf", model_path=str(d), max_model_len=4096, seed=0))


def test_an_openai_client_episode_records_exactly_what_the_engine_sampled(served, tiny_engine):
    """Three turns through the plain openai client against the HF engine: every assistant turn of the
    trajectory is the engine's ids, log-probs and versions as returned, each generate call saw exactly the
    trajectory before it, and everything between the turns is observation (no log-prob, no version)."""
    lt, ep = served
    engine = RecordingEngine(tiny_engine)
    s = lt.call(ep.open_session, engine, cfg(max_new_tokens_per_turn=24), prompt_id="p", env="test")
    c = client(ep, s)
    assert [m.id for m in c.models.list().data] == ["policy"]
    msgs = [{"role": "system", "content": "Fix it."}, {"role": "user", "content": "2+2 is 5"}]
    for turn in range(3):
        r = c.chat.completions.create(model="policy", messages=msgs, tools=[BASH_TOOL])
        m = r.choices[0].message
        assert r.usage.completion_tokens == len(engine.results[-1].token_ids)
        msgs.append(m.model_dump(exclude_none=True))
        if m.tool_calls:
            msgs += [{"role": "tool", "tool_call_id": t.id, "content": f"out {turn}"} for t in m.tool_calls]
        else:
            msgs.append({"role": "user", "content": f"go on {turn}"})
    [traj] = s.finish(reward=1.0)
    assert traj.status == "terminated" and traj.reward == 1.0 and traj.info["segments"] == 1
    assert traj.info["rewrites"] == 0 and len(engine.results) == 3
    actions = [(s_.start, s_.end) for s_ in traj.spans if s_.kind == "action"]
    for (a, b), prompt, res in zip(actions, engine.prompts, engine.results):
        assert traj.tokens[:a].tolist() == prompt  # the engine was fed the trajectory as recorded
        assert traj.tokens[a:b].tolist() == res.token_ids  # and its sample is recorded as sampled
        assert traj.rollout_logprobs[a:b].tolist() == pytest.approx(res.logprobs, abs=0, rel=1e-6)
        assert traj.versions[a:b].tolist() == list(res.versions)
    off = ~traj.action_mask
    assert (traj.rollout_logprobs[off] == 0).all() and (traj.versions[off] == -1).all()
    assert int(traj.action_mask.sum()) == sum(len(r.token_ids) for r in engine.results)


def test_unchanged_turns_reuse_tokens_and_a_rewritten_history_starts_a_segment(served):
    """The client echoes the assistant turn its own way (ids renumbered, arguments re-spaced): the same
    segment. Then it summarises the history: a new segment whose whole history is observation, and the
    episode's trajectories say so; the earlier segment bootstraps from the episode's reward."""
    lt, ep = served
    engine = ScriptedTextEngine(TOK, STOP, [CALL, "then", "after summary", "done"])
    s = lt.call(ep.open_session, engine, cfg(), prompt_id="p", env="test")
    c = client(ep, s)
    msgs = [{"role": "user", "content": "fix the bug"}]
    m = c.chat.completions.create(model="policy", messages=msgs, tools=[BASH_TOOL]).choices[0].message
    assert m.tool_calls[0].function.name == "bash" and m.content is None
    echo = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "other-id", "type": "function", "function": {"name": "bash", "arguments": '{"command":"ls"}'}}]}
    msgs += [echo, {"role": "tool", "tool_call_id": "other-id", "content": "a.py"}]
    second = c.chat.completions.create(model="policy", messages=msgs, tools=[BASH_TOOL]).choices[0].message
    assert second.content == "then" and s.stats.rewrites == 0
    assert engine.prompts[1][:len(engine.prompts[0])] == engine.prompts[0]  # extended, not re-rendered
    summary = [{"role": "user", "content": "fix the bug"}, {"role": "user", "content": "So far: ran ls."}]
    c.chat.completions.create(model="policy", messages=summary, tools=[BASH_TOOL])
    msgs2 = summary + [{"role": "assistant", "content": "after summary"}, {"role": "user", "content": "go"}]
    c.chat.completions.create(model="policy", messages=msgs2, tools=[BASH_TOOL])
    first, last = s.finish(reward=1.0)
    assert (first.info["segment"], last.info["segment"], last.info["segments"]) == (0, 1, 2)
    assert first.info["segment_start"] == "prompt" and last.info["segment_start"] == "rewritten_history"
    assert first.status == "truncated" and first.bootstrap == 1.0 and first.reward == 0.0
    assert last.status == "terminated" and last.reward == 1.0 and first.info["episode"] == last.info["episode"]
    assert [s_.kind for s_ in first.spans] == ["prompt", "action", "observation", "action"]
    assert [s_.kind for s_ in last.spans] == ["observation", "action", "observation", "action"]
    # the new segment starts from the request rendered afresh, all of it observation
    rendered, extra = ep.tool_format.template_messages(
        [{"role": "user", "content": "fix the bug"}, {"role": "user", "content": "So far: ran ls."}], [BASH_TOOL])
    assert engine.prompts[2] == F.prompt_ids(rendered, **extra) == spans_of(last, "observation")[0]
    assert spans_of(first, "action") + spans_of(last, "action") == [r.token_ids for r in engine.results]


def test_limits_and_errors_answer_like_openai(served):
    lt, ep = served
    engine = ScriptedTextEngine(TOK, STOP, ["one", "two"])
    s = lt.call(ep.open_session, engine, cfg(max_turns=2), prompt_id="p", env="test")
    c = client(ep, s)
    msgs = [{"role": "user", "content": "hi"}]
    for text in ("one", "two"):
        m = c.chat.completions.create(model="policy", messages=msgs, temperature=0.2).choices[0].message
        assert m.content == text
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="policy", messages=msgs)
    assert e.value.code == "context_length_exceeded" and "rollout.max_turns" in str(e.value)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        c.chat.completions.create(model="policy", messages=msgs, n=2)
    with pytest.raises(openai.BadRequestError, match="unsupported request fields"):
        c.chat.completions.create(model="policy", messages=msgs, extra_body={"best_of": 3})
    [traj] = s.finish(reward=0.5)
    assert traj.status == "truncated" and traj.bootstrap == 0.0 and traj.info["end_reason"] == "max_turns"
    assert traj.info["ignored_request_fields"] == {"temperature": 2}  # the run's sampling is what samples
    assert engine.prompts and all(len(p) for p in engine.prompts)
    lt.call(ep.close_session, s)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="policy", messages=msgs)
    nokey = openai.OpenAI(base_url=f"{ep.url}/v1", api_key="not-an-episode", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        nokey.chat.completions.create(model="policy", messages=msgs)


def test_streaming_gives_the_same_turn(served):
    lt, ep = served
    engine = ScriptedTextEngine(TOK, STOP, ["hello " + CALL])
    s = lt.call(ep.open_session, engine, cfg(), prompt_id="p", env="test")
    # the key as the API key on the shared /v1 URL works as well as the episode's base URL
    c = openai.OpenAI(base_url=f"{ep.url}/v1", api_key=s.key, max_retries=0)
    chunks = list(c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}],
                                            tools=[BASH_TOOL], stream=True, stream_options={"include_usage": True}))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    calls = [t for ch in chunks if ch.choices for t in ch.choices[0].delta.tool_calls or []]
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert content == "hello" and json.loads(calls[0].function.arguments) == {"command": "ls"}
    assert finish == ["tool_calls"] and chunks[-1].usage.completion_tokens == len(engine.results[0].token_ids)


class _ClientHarness:
    """A harness environment whose agent is the plain openai client in a thread of its own."""

    name = "client_harness"

    def __init__(self, turns: int) -> None:
        self.turns, self.errors, self.closed = turns, [], False

    async def run_harness(self, task, endpoint) -> HarnessOutcome:
        def agent():
            c = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
            msgs = list(task.messages)
            for _ in range(self.turns):
                try:
                    m = c.chat.completions.create(model=endpoint.model, messages=msgs).choices[0].message
                except openai.APIStatusError as e:
                    self.errors.append(e.status_code)
                    return
                msgs += [{"role": "assistant", "content": m.content}, {"role": "user", "content": "next"}]
        self.thread = threading.Thread(target=agent)
        self.thread.start()
        await asyncio.to_thread(self.thread.join)
        return HarnessOutcome(reward=0.75, info={"graded": True})

    async def close(self) -> None:
        self.closed = True


class _EngineDiesAsHarnessReturns(ScriptedTextEngine):
    """Its ``fail_on`` call resolves ``gave_up`` before it raises: the harness waiting on it returns in the
    same loop iteration as the session's ``failed`` event wakes, so the episode finds both done."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gave_up = asyncio.get_running_loop().create_future()

    async def generate(self, prompt_ids, sampling):
        if len(self.prompts) == self.fail_on:
            self.gave_up.set_result(None)
        return await super().generate(prompt_ids, sampling)


class _HarnessReturnsOnEngineFailure:
    name = "client_harness"

    def __init__(self, engine: _EngineDiesAsHarnessReturns) -> None:
        self.engine = engine

    async def run_harness(self, task, endpoint) -> HarnessOutcome:
        c = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
        msgs = list(task.messages)
        m = (await c.chat.completions.create(model=endpoint.model, messages=msgs)).choices[0].message
        msgs += [{"role": "assistant", "content": m.content}, {"role": "user", "content": "next"}]
        self.second = asyncio.ensure_future(c.chat.completions.create(model=endpoint.model, messages=msgs))
        await self.engine.gave_up
        return HarnessOutcome(reward=0.75, info={"graded": True})

    async def close(self) -> None:
        pass


def test_an_engine_failure_wins_over_a_harness_that_returned_at_the_same_moment(served):
    """The harness graded an episode cut by a dead engine: that grade is not the episode's reward (it
    would train a truncated episode as if it ended); the episode fails and the driver re-runs it."""
    from megatron_sao.envs.base import Task

    lt, ep = served
    task = Task("p1", [{"role": "user", "content": "go"}], None, "client_harness")

    async def episode():
        engine = _EngineDiesAsHarnessReturns(TOK, STOP, ["a", "b"], fail_on=1)
        env = _HarnessReturnsOnEngineFailure(engine)
        trajs = await run_harness_episode(engine, env, task, ep, cfg())
        with pytest.raises(openai.APIStatusError):  # its request got the failed turn's answer
            await env.second
        return trajs

    [traj] = lt.run(episode())
    assert traj.status == "failed" and traj.info["end_reason"] == "engine_error" and "went away" in traj.error


def test_a_harness_episode_ends_with_the_environment_s_reward_or_fails_with_its_engine(served):
    from megatron_sao.envs.base import Task

    lt, ep = served
    task = Task("p0", [{"role": "user", "content": "go"}], None, "client_harness")
    env = _ClientHarness(turns=2)
    engine = ScriptedTextEngine(TOK, STOP, ["a", "b"])
    before = set(ep.sessions)
    [traj] = lt.run(run_harness_episode(engine, env, task, ep, cfg()))
    assert traj.status == "terminated" and traj.reward == 0.75 and traj.info["harness"] == {"graded": True}
    assert env.closed and set(ep.sessions) == before  # the session is gone, the environment closed
    env = _ClientHarness(turns=3)
    dead = ScriptedTextEngine(TOK, STOP, ["a", "b"], fail_on=1)
    [traj] = lt.run(run_harness_episode(dead, env, task, ep, cfg()))
    assert traj.status == "failed" and traj.info["end_reason"] == "engine_error" and "went away" in traj.error
    env.thread.join(30)  # the episode did not wait for its harness: it gets 503 (the failed turn) or 404 (closed)
    assert env.errors and env.errors[0] in (503, 404) and env.closed
