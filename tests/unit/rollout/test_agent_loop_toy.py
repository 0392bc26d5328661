"""The agent loop with the demo's real pieces: char tokenizer + ChatFormatter + the toy calculator env.

An oracle engine (reads the conversation from the token prefix, the way a perfect policy would) must
earn reward 1, and the trajectory must have exactly the layout SFT demonstrations get from
``ChatFormatter.encode_demonstration``: the policy is trained on what it later samples into.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from megatron_sao.rollout.agent_loop import AgentLoopConfig, run_many
from megatron_sao.rollout.chat import ChatFormatter
from megatron_sao.rollout.engines.protocol import SamplingParams
from megatron_sao.tokenizers import build_char_tokenizer, char_token_id
from tests.unit.rollout.test_agent_loop_fakes import ScriptedEngine

toy = pytest.importorskip("megatron_sao.envs.toy_tool")

TOK = build_char_tokenizer()
F = ChatFormatter(TOK)
END = char_token_id(TOK, "<|end|>")


def oracle(n: int, prefix: list[int]) -> list[int]:
    """The next correct action for the conversation in ``prefix``: a calculator call or the answer."""
    text = TOK.decode(prefix)
    question = re.search(r"<\|user\|>(.*?)<\|end\|>", text).group(1)
    nums, ops = re.findall(r"\d+", question), re.findall(r"(?<=\d)[-+*]", question)
    results = re.findall(r"<\|tool\|>(.*?)<\|end\|>", text)
    cur = results[-1] if results else nums[0]
    k = len(results)
    action = f"<c>{cur}{ops[k]}{nums[k + 1]}</c>" if k < len(ops) else f"={cur}"
    return TOK.encode(action, add_special_tokens=False) + [END]


def test_oracle_policy_solves_toy_tasks_with_the_sft_token_layout():
    tasks = list(toy.load_toy_tasks(n=6, seed=3, max_ops=3))
    cfg = AgentLoopConfig(max_turns=6, max_total_tokens=256, max_new_tokens_per_turn=24,
                          sampling=SamplingParams(max_new_tokens=24), max_concurrency=3)
    trajs = asyncio.run(run_many(ScriptedEngine(oracle), lambda t: toy.ToyToolEnv(), tasks, F, cfg))
    for task, traj in zip(tasks, trajs):
        assert traj.status == "terminated" and traj.reward == 1.0, (traj.error, traj.info)
        assert traj.num_turns == task.meta["n_ops"] + 1
        # Rebuild the conversation as text and encode it as an SFT demonstration.
        conv, text = list(task.messages), TOK.decode(traj.tokens.tolist())
        for action, tool in re.findall(r"<\|assistant\|>(.*?)<\|end\|>(?:<\|tool\|>(.*?)<\|end\|>)?", text):
            conv.append({"role": "assistant", "content": action})
            if tool:
                conv.append({"role": "tool", "content": tool})
        ids, mask = F.encode_demonstration(conv)
        assert traj.tokens.tolist() == ids and traj.action_mask.tolist() == mask
