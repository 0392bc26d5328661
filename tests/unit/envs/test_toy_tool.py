"""Toy calculator task: long-tailed generator, env rewards, demonstrations and their error rate."""

import asyncio
from collections import Counter

import pytest

from megatron_sao.envs.base import Task
from megatron_sao.envs.toy_tool import (
    ANSWER_RE,
    CALL_RE,
    ENV_NAME,
    TOY_ALPHABET,
    ToyToolEnv,
    ToyToolTasks,
    calculate,
    evaluate,
    make_demonstrations,
    op_count_pmf,
)


def test_generator_is_seeded_and_valid():
    a, b = ToyToolTasks(50, seed=7), ToyToolTasks(50, seed=7)
    assert [t.messages for t in a] == [t.messages for t in b]
    assert [t.messages for t in a] != [t.messages for t in ToyToolTasks(50, seed=8)]
    for t in a:
        q = t.messages[0]["content"]
        assert t.messages == [{"role": "user", "content": q}]  # no system prompt
        assert set(q) <= set(TOY_ALPHABET) and len(q) <= 40
        assert sum(q.count(o) for o in "+-*") == t.meta["n_ops"]


def test_op_count_distribution_has_a_long_tail():
    max_ops, n = 8, 4000
    tasks = ToyToolTasks(n, seed=0, max_ops=max_ops, alpha=1.5)
    counts = Counter(t.meta["n_ops"] for t in tasks)
    pmf = op_count_pmf(max_ops, 1.5)
    assert set(counts) == set(range(1, max_ops + 1))  # the longest chains do occur
    for k in range(1, max_ops + 1):
        assert abs(counts[k] / n - pmf[k - 1]) < 0.025, (k, counts[k] / n, pmf[k - 1])
    # power law, not geometric: the decay ratio p(k+1)/p(k) grows towards 1 in the tail
    assert pmf[7] / pmf[6] > pmf[1] / pmf[0] + 0.2
    assert sum(counts[k] for k in range(5, 9)) / n > 0.08


async def play_async(task, actions, **kw):
    env = ToyToolEnv(**kw)
    await env.reset(task)
    out = []
    for a in actions:
        out.append(await env.step(a))
        if out[-1].done:
            break
    return out


def play(task, actions, **kw):
    return asyncio.run(play_async(task, actions, **kw))


def task_for(question: str) -> Task:
    """A toy task for a hand-written question (left-to-right evaluation)."""
    nums = [int(x) for x in question.replace("*", "+").replace("-", "+").split("+")]
    ops = [c for c in question if c in "+-*"]
    return Task("q", [{"role": "user", "content": question}], evaluate(nums, ops), ENV_NAME)


def test_env_rewards_correct_tool_based_answer():
    rs = play(task_for("3*4+5"), ["<c>3*4</c>", "<c>12+5</c>", "=17"])
    assert [r.observation for r in rs] == ["12", "17", None]
    assert rs[-1].done and rs[-1].reward == 1.0 and rs[-1].info["tool_calls"] == 2


def test_env_wrong_answer_and_guess_and_garbage():
    assert play(task_for("3*4+5"), ["<c>3*4</c>", "<c>12+5</c>", "=18"])[-1].reward == 0.0
    guess = play(task_for("3*4+5"), ["=17"])[-1]
    assert guess.reward == 0.0 and guess.info["reason"] == "answer_not_from_tool"
    assert play(task_for("3*4+5"), ["=17"], require_tool_result=False)[-1].reward == 1.0
    junk = play(task_for("3*4+5"), ["hmm 17"])[-1]
    assert junk.done and junk.reward == 0.0 and junk.info["reason"] == "no_tool_call_or_answer"
    assert play(task_for("3*4+5"), ["<c>3*</c>"])[0].observation == "ERR"


def test_env_tool_call_limit():
    rs = play(task_for("3*4+5"), ["<c>1+1</c>"] * 5, max_tool_calls=3)
    assert len(rs) == 4 and rs[-1].info["truncated"] is True


def test_calculator():
    assert calculate("37*48") == "1776" and calculate("-5-3") == "-8" and calculate("5/2") == "ERR"


async def replay(demo):
    """Feed a demonstration's assistant turns to the env; return the reward it earns."""
    task = task_for(demo[0]["content"])
    actions = [m["content"] for m in demo if m["role"] == "assistant"]
    results = await play_async(task, actions)
    tool_msgs = [m["content"] for m in demo if m["role"] == "tool"]
    assert [r.observation for r in results[:-1]] == tool_msgs  # the demo agrees with the real tool
    return results[-1].reward


def test_demonstrations_parse_and_are_short():
    for demo in make_demonstrations(200, seed=1, error_rate=0.3):
        assert [m["role"] for m in demo[:2]] == ["user", "assistant"] and demo[-1]["role"] == "assistant"
        for m in demo[1:-1:2]:
            assert CALL_RE.fullmatch(m["content"]), m
        assert ANSWER_RE.fullmatch(demo[-1]["content"])
        assert sum(len(m["content"]) for m in demo) < 200
        assert all(set(m["content"]) <= set(TOY_ALPHABET) for m in demo)


@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_demonstration_error_rate(rate):
    n = 1500
    demos = make_demonstrations(n, seed=5, error_rate=rate)

    async def main():
        return [await replay(d) for d in demos]
    wrong = sum(r == 0.0 for r in asyncio.run(main())) / n
    # binomial sd at 0.3 is 0.012; an error can (rarely) cancel out, e.g. a product with 0
    assert abs(wrong - rate) < 0.04, wrong
