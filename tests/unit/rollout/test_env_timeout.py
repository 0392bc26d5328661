"""A hung environment is the environment's failure, named: its tool call past the agent loop's bound
(rollout.timeout_s) fails the episode naming the environment and the call, and while it hangs the
rollout side can say what it waits on (the trainer's batch wait blamed "rollout engine")."""

from __future__ import annotations

import asyncio

from megatron_sao.rollout.agent_loop import EngineActivity, run_episode
from megatron_sao.rollout.chat import ChatFormatter
from megatron_sao.rollout.engines.protocol import SamplingParams
from megatron_sao.tokenizers import build_char_tokenizer
from tests.unit.rollout.test_agent_loop import END, cfg, enc
from tests.unit.rollout.test_agent_loop_fakes import CountingEnv, ScriptedEngine, task

F = ChatFormatter(build_char_tokenizer())
CALL = '<tool_call>{"name": "python", "arguments": {"code": "while True: pass"}}</tool_call>'


class HangingEnv(CountingEnv):
    """Its tool never returns (a stuck service, a call without a timeout of its own)."""

    name = "hanging"

    async def step(self, action_text):
        self.actions.append(action_text)
        await asyncio.Event().wait()


def _tool_call(n, prefix):
    return enc(CALL) + [END]


def _cfg(timeout: float):
    return cfg(env_timeout_s=timeout, max_total_tokens=512, max_new_tokens_per_turn=128,
               sampling=SamplingParams(max_new_tokens=128))


def test_a_hung_tool_call_fails_the_episode_naming_the_environment_and_the_call():
    env, activity = HangingEnv(), EngineActivity()
    seen = []

    async def main():
        episode = asyncio.ensure_future(run_episode(ScriptedEngine(_tool_call), env, task(), F,
                                                    _cfg(1.0), activity=activity))
        while not env.actions:
            await asyncio.sleep(0.01)
        seen.append(activity.env_calls.describe_oldest())  # what a batch wait running out reports
        return await asyncio.wait_for(episode, 30)  # unbounded, it waited for ever

    traj = asyncio.run(main())
    assert traj.status == "failed" and traj.info["end_reason"] == "env_timeout" and not traj.trainable
    assert "environment 'counting' did not return within 1s (rollout.timeout_s)" in traj.error, traj.error
    assert "step() of tool call \"python({'code': 'while True: pass'})\"" in traj.error, traj.error
    assert env.closed and activity.env_calls.oldest() is None
    assert seen[0].startswith("1 episode(s) wait on their environment; the longest, for 0s, on environment "
                              "'counting': step() of tool call"), seen


def test_an_environment_timeout_of_its_own_stays_its_error():
    """A TimeoutError the tool raises itself (a socket, a subprocess) is not reported as the loop's bound."""
    class OwnTimeout(CountingEnv):
        async def step(self, action_text):
            raise TimeoutError("the service did not answer")

    traj = asyncio.run(run_episode(ScriptedEngine(_tool_call), OwnTimeout(), task(), F, _cfg(30.0)))
    assert traj.info["end_reason"] == "error" and traj.error == "TimeoutError: the service did not answer"
