"""run_episode / run_many: masks, log-probs, limits, failures, aborts, finish-order delivery."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_sao.envs.base import StepResult
from megatron_sao.rollout.agent_loop import AgentLoopConfig, EngineActivity, run_episode, run_many
from megatron_sao.rollout.chat import ChatFormatter
from megatron_sao.rollout.engines.protocol import SamplingParams
from megatron_sao.tokenizers import build_char_tokenizer, char_token_id
from tests.unit.rollout.test_agent_loop_fakes import CountingEnv, ScriptedEngine, lp, qwen_shape_tokenizer, task

TOK = build_char_tokenizer()
F = ChatFormatter(TOK)
END = char_token_id(TOK, "<|end|>")


def enc(text: str, tok=TOK) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def calls(n: int, prefix: list[int]) -> list[int]:
    """The n-th action: 'CALL <n>' + <|end|>."""
    return enc(f"CALL {n}") + [END]


def cfg(**kw) -> AgentLoopConfig:
    base = dict(max_turns=8, max_total_tokens=256, max_new_tokens_per_turn=32,
                sampling=SamplingParams(max_new_tokens=32), max_concurrency=4)
    return AgentLoopConfig(**{**base, **kw})


def play(engine, env, c=None, t=None, formatter=F):
    return asyncio.run(run_episode(engine, env, t or task(), formatter, c or cfg()))


def test_action_mask_covers_exactly_the_sampled_ids_with_their_logprobs_and_versions():
    engine, env = ScriptedEngine(calls, version=7), CountingEnv(done_after=3, reward=1.0)
    traj = play(engine, env)
    assert traj.status == "terminated" and traj.reward == 1.0 and traj.bootstrap is None
    assert [s.kind for s in traj.spans] == ["prompt", "action", "observation", "action", "observation", "action"]
    for k, span in enumerate(s for s in traj.spans if s.kind == "action"):
        sampled = calls(k, [])
        assert traj.tokens[span.start:span.end].tolist() == sampled  # stop token kept
        assert traj.action_mask[span.start:span.end].all()
        assert traj.rollout_logprobs[span.start:span.end].tolist() == \
            pytest.approx([lp(i) for i in range(len(sampled))])
        assert (traj.versions[span.start:span.end] == 7).all()
    off = ~traj.action_mask
    assert (traj.rollout_logprobs[off] == 0).all() and (traj.versions[off] == -1).all()
    assert int(traj.action_mask.sum()) == sum(len(calls(k, [])) for k in range(3))
    assert env.actions == ["CALL 0", "CALL 1", "CALL 2"]  # text without the stop token
    assert env.closed and traj.info["end_reason"] == "env_done" and traj.info["turns"] == 3
    assert traj.timings["generate_s"] >= 0 and traj.timings["env_s"] >= 0


def test_engine_is_fed_exactly_the_trajectory_prefix():
    engine = ScriptedEngine(calls)
    traj = play(engine, CountingEnv(done_after=3))
    for prefix, sampling in engine.calls:
        assert traj.tokens[:len(prefix)].tolist() == prefix
        assert set(F.stop_token_ids) <= set(sampling.stop_token_ids)
    assert traj.tokens[:len(engine.calls[0][0])].tolist() == F.prompt_ids(task().messages)


def test_trajectory_equals_the_template_rendering_of_the_conversation():
    """No drift: appended ids == apply_chat_template(full conversation) for the char template."""
    env = CountingEnv(done_after=3)
    traj = play(ScriptedEngine(calls), env)
    conv = list(task().messages)
    for k, action in enumerate(env.actions):
        conv.append({"role": "assistant", "content": action})
        if k < 2:
            conv.append({"role": "tool", "content": f"r{k + 1}"})
    assert traj.tokens.tolist() == enc(TOK.apply_chat_template(conv, tokenize=False))


def test_qwen_shape_trajectory_has_no_drift():
    tok = qwen_shape_tokenizer()
    f = ChatFormatter(tok)
    im_end = char_token_id(tok, "<|im_end|>")
    engine = ScriptedEngine(lambda n, p: enc(f"CALL {n}", tok) + [im_end])
    env = CountingEnv(done_after=2)
    traj = play(engine, env, formatter=f)
    conv = list(task().messages) + [{"role": "assistant", "content": "CALL 0"}, {"role": "tool", "content": "r1"},
                                    {"role": "assistant", "content": "CALL 1"}]
    assert traj.tokens.tolist() + enc("\n", tok) == enc(tok.apply_chat_template(conv, tokenize=False), tok)


def _critic_trained_positions(traj) -> set[int]:
    """Positions t whose value V[t] (state ending with token t) gets a critic target: the GAE pairs
    the action token at t+1 with V[t] (trainer/targets.py values_for_actions)."""
    return {t for t in range(traj.length - 1) if traj.action_mask[t + 1]}


def test_truncation_by_turns_bootstraps_from_a_state_the_critic_is_trained_on():
    short = play(ScriptedEngine(calls), CountingEnv(done_after=100), cfg(max_turns=2))
    assert short.status == "truncated" and short.bootstrap == "critic" and short.reward == 0.0
    assert short.info["end_reason"] == "max_turns" and short.num_turns == 2
    # The same episode with one more turn: the cut one is a prefix of it up to the observation after
    # turn 2, and its bootstrap position (the last one) is where the longer episode's critic learns
    # V(state before action 3). Ending on the stop token, as before, gave a position no trajectory trains.
    longer = play(ScriptedEngine(calls), CountingEnv(done_after=100), cfg(max_turns=3))
    assert torch.equal(longer.tokens[:short.length], short.tokens)
    assert short.spans[-1].kind == "observation" and not short.action_mask[-1]
    assert short.length - 1 in _critic_trained_positions(longer)
def test_truncation_by_total_tokens_inside_a_turn():
    prompt_len = len(F.prompt_ids(task().messages))
    long_action = lambda n, p: enc("X" * 50) + [END]  # noqa: E731
    engine = ScriptedEngine(long_action)
    traj = play(engine, CountingEnv(done_after=100), cfg(max_total_tokens=prompt_len + 80, max_new_tokens_per_turn=60))
    assert traj.status == "truncated" and traj.bootstrap == "critic" and traj.info["end_reason"] == "max_total_tokens"
    assert traj.length == prompt_len + 80 and traj.action_mask[-1]  # mid-action: a state the critic trains
    assert traj.info["finish_reasons"][-1] == "length"
    # the last turn was asked for exactly the tokens left
    assert engine.calls[-1][1].max_new_tokens == prompt_len + 80 - len(engine.calls[-1][0])


def test_truncation_when_the_observation_leaves_no_room_for_an_action():
    prompt_len = len(F.prompt_ids(task().messages))
    action = enc("CALL 0") + [END]
    obs = F.observation_ids("tool", "r1", action)
    # Exactly no token left for turn 2: the observation still fits, so it closes the trajectory and
    # the bootstrap state is "before the next action" (trained), not the stop token (never trained).
    c = cfg(max_total_tokens=prompt_len + len(action) + len(obs))
    traj = play(ScriptedEngine(lambda n, p: action), CountingEnv(done_after=100), c)
    assert traj.status == "truncated" and traj.info["end_reason"] == "max_total_tokens"
    assert traj.bootstrap == "critic" and traj.length == prompt_len + len(action) + len(obs)
    assert traj.spans[-1].kind == "observation"
    # One token less: the observation does not fit; the trajectory ends with the stop token and
    # bootstraps from the state that token was sampled in (trained), not from 0 like a failure.
    c = cfg(max_total_tokens=prompt_len + len(action) + len(obs) - 1)
    traj = play(ScriptedEngine(lambda n, p: action), CountingEnv(done_after=100), c)
    assert traj.status == "truncated" and traj.info["end_reason"] == "max_total_tokens"
    assert traj.bootstrap == "critic_before_stop" and traj.info["bootstrap"] == "no_room_for_observation"
    assert traj.length == prompt_len + len(action) and traj.action_mask[-1]


def test_environment_truncation_keeps_the_env_reward_and_is_terminal():
    class PartialCredit(CountingEnv):  # the env's own tool-call limit, with a reward for what was done
        async def step(self, action_text):
            res = await super().step(action_text)
            return StepResult(None, True, 0.25, res.info) if res.done else res

    traj = play(ScriptedEngine(calls), PartialCredit(done_after=2, truncated=True))
    assert traj.status == "truncated" and traj.info["end_reason"] == "env_truncated"
    assert traj.reward == 0.25  # was dropped (0.0)
    assert traj.bootstrap == 0.0 and traj.action_mask[-1]  # no later state exists to value


def test_per_turn_length_cut_mid_episode_closes_the_turn_and_continues():
    engine = ScriptedEngine(lambda n, p: enc("Y" * 10) + [END] if n == 0 else calls(n, p))
    env = CountingEnv(done_after=2)
    traj = play(engine, env, cfg(max_new_tokens_per_turn=5))
    assert traj.status == "terminated" and traj.info["finish_reasons"] == ["length", "length"]
    obs = next(s for s in traj.spans if s.kind == "observation")
    assert traj.tokens[obs.start] == END  # the template's closing, added for the cut turn
    assert env.actions[0] == "YYYYY"


def test_abort_regenerates_the_turn_from_the_same_prefix():
    engine = ScriptedEngine(calls, version=0, aborts=2)
    traj = play(engine, CountingEnv(done_after=1))
    assert traj.status == "terminated" and traj.info["abort_retries"] == 2
    prompt = F.prompt_ids(task().messages)
    assert [p for p, _ in engine.calls] == [prompt] * 3  # partial tokens dropped, same prefix each time
    assert traj.tokens[len(prompt):].tolist() == calls(2, [])
    assert (traj.versions[traj.action_mask] == 2).all()  # sampled entirely by the new weights


def test_too_many_aborts_fail_the_episode():
    traj = play(ScriptedEngine(calls, aborts=5), CountingEnv(), cfg(max_abort_retries=2))
    assert traj.status == "failed" and traj.error.startswith("AbortRetriesExceeded")


def test_engine_error_gives_a_failed_trajectory_and_closes_the_env():
    env = CountingEnv()
    traj = play(ScriptedEngine(calls, fail_on_call=1), env)
    assert traj.status == "failed" and traj.reward == 0.0 and traj.error == "ConnectionError: engine went away"
    assert traj.info["end_reason"] == "engine_error" and env.closed and not traj.trainable


def test_env_without_observation_or_too_long_prompt_fails_clearly():
    class Silent(CountingEnv):
        async def step(self, action_text):
            return StepResult(None, False)

    traj = play(ScriptedEngine(calls), Silent())
    assert traj.status == "failed" and "observation=None" in traj.error
    traj = play(ScriptedEngine(calls), CountingEnv(), cfg(max_total_tokens=4))
    assert traj.status == "failed" and "leaves no room" in traj.error


def test_run_many_isolates_failures_and_hands_over_in_finish_order():
    """Episodes finish in an order the test controls (gates, no sleeps); each is delivered before the next ends."""
    tasks = [task(i) for i in range(5)]
    order = ["p1", "p3", "p2", "p4", "p0"]  # finish order, unlike submission order
    done: list[str] = []

    async def main():
        gates = {t.prompt_id: asyncio.Event() for t in tasks}
        delivered = asyncio.Event()

        class Gated(CountingEnv):
            async def step(self, action_text):
                await gates[self.task.prompt_id].wait()
                return await super().step(action_text)

        def env_factory(t):
            return Gated(done_after=2, raise_on_step=2 if t.prompt_id == "p2" else None)

        def on_done(traj):
            done.append(traj.prompt_id)
            delivered.set()

        async def conductor():
            for pid in order:
                delivered.clear()
                gates[pid].set()
                # the others are still blocked, so a loop that waited for a group would time out here
                await asyncio.wait_for(delivered.wait(), 30)

        trajs, _ = await asyncio.gather(run_many(ScriptedEngine(calls), env_factory, tasks, F,
                                                 cfg(max_concurrency=5), on_done=on_done), conductor())
        return trajs

    trajs = asyncio.run(main())
    assert done == order
    assert [t.prompt_id for t in trajs] == [t.prompt_id for t in tasks]  # returned in task order
    by_id = {t.prompt_id: t for t in trajs}
    assert by_id["p2"].status == "failed" and by_id["p2"].error == "RuntimeError: tool crashed on step 2"
    assert all(by_id[p].status == "terminated" for p in ("p0", "p1", "p3", "p4"))


def test_run_many_respects_max_concurrency_and_factory_errors():
    engine = ScriptedEngine(calls, delay=lambda p: 0.01)

    def env_factory(t):
        if t.prompt_id == "p3":
            raise KeyError("no env for this task")
        return CountingEnv(done_after=2)

    trajs = asyncio.run(run_many(engine, env_factory, [task(i) for i in range(8)], F, cfg(max_concurrency=2)))
    assert engine.max_active <= 2
    assert trajs[3].status == "failed" and trajs[3].error.startswith("KeyError")
    assert trajs[3].info["placeholder_tokens"] and trajs[3].tokens.tolist() == [F.pad_token_id]
    assert sum(t.status == "terminated" for t in trajs) == 7


def test_run_many_propagates_consumer_errors():
    def on_done(t):
        raise OSError("buffer full")

    with pytest.raises(ExceptionGroup) as ei:
        asyncio.run(run_many(ScriptedEngine(calls), lambda t: CountingEnv(1), [task(0)], F, cfg(), on_done=on_done))
    assert ei.group_contains(OSError)


def test_engine_activity_counts_idle_time_only_with_nothing_in_flight(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("megatron_sao.rollout.agent_loop.time.monotonic", lambda: clock[0])
    a = EngineActivity()
    clock[0] = 103.0
    a.begin()  # 3 s idle
    a.begin()
    clock[0] = 110.0
    a.end()  # still one in flight: not idle
    clock[0] = 112.0
    a.end()
    clock[0] = 115.0  # idle again for 3 s
    assert a.active == 0 and a.idle_s == pytest.approx(3.0) and a.total_idle_s() == pytest.approx(6.0)


def test_config_validation():
    with pytest.raises(ValueError, match="max_turns"):
        AgentLoopConfig(max_turns=0)
    with pytest.raises(TypeError, match="sampling"):
        AgentLoopConfig(sampling={"max_new_tokens": 4})


def test_real_hf_engine_episode_with_a_tiny_random_model():
    """One episode against the real HFEngine (random tiny Qwen3 over the char vocabulary)."""
    hf_engine = pytest.importorskip("megatron_sao.rollout.engines.hf_engine")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)).eval()
    engine = hf_engine.HFEngine(model, max_model_len=256, eos_token_ids=F.stop_token_ids, seed=0)
    c = cfg(max_total_tokens=96, max_new_tokens_per_turn=16, max_turns=3,
            sampling=SamplingParams(max_new_tokens=16, seed=1))

    async def main():
        try:
            return await run_episode(engine, CountingEnv(done_after=2), task(), F, c)
        finally:
            await engine.close()

    traj = asyncio.run(main())
    assert traj.status in ("terminated", "truncated"), traj.error
    prompt = F.prompt_ids(task().messages)
    assert traj.tokens[:len(prompt)].tolist() == prompt and traj.length <= 96
    on = traj.action_mask
    assert (traj.rollout_logprobs[on] < 0).all() and (traj.versions[on] == engine.version).all()


def test_a_fixed_sampling_seed_becomes_a_distinct_reproducible_seed_per_prompt_and_turn():
    c = cfg(sampling=SamplingParams(max_new_tokens=32, seed=5))
    seeds = []
    for i in (0, 1, 0):
        engine = ScriptedEngine(calls)
        play(engine, CountingEnv(done_after=2), c, t=task(i))
        seeds.append([s.seed for _, s in engine.calls])
    assert seeds[0] == seeds[2]  # reproducible
    assert len(set(seeds[0])) == 2 and not set(seeds[0]) & set(seeds[1])  # distinct per turn and prompt
    engine = ScriptedEngine(calls)
    play(engine, CountingEnv(done_after=2))
    assert all(s.seed is None for _, s in engine.calls)  # no seed stays no seed


def test_an_answer_that_ends_exactly_on_the_budget_still_reaches_the_environment():
    prompt_len = len(F.prompt_ids(task().messages))
    answer = enc("ANS 17") + [END]
    traj = play(ScriptedEngine(lambda n, p: answer), CountingEnv(done_after=1, reward=1.0),
                cfg(max_total_tokens=prompt_len + len(answer)))
    assert traj.status == "terminated" and traj.reward == 1.0 and traj.length == prompt_len + len(answer)
