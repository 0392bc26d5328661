"""The chain environments (toy calculator and Python tool): a correct chain succeeds, a wrong
intermediate step shows in the next tool result and every one after, tasks are deterministic per seed."""

import asyncio

import pytest

from megatron_sao.envs import chain_python as cp
from megatron_sao.envs import load_tasks, make_env
from megatron_sao.envs import toy_chain as tc
from megatron_sao.envs.registry import reference_actions_of
from megatron_sao.envs.toy_tool import evaluate


async def _play(env_name: str, task, actions: list[str]):
    env = make_env(env_name)
    await env.reset(task)
    results = [await env.step(a) for a in actions]
    await env.close()
    return results


def _wrong_second_step(actions: list[str], digit_at: int) -> list[str]:
    """The reference actions with one digit of the second call's first operand changed."""
    call = actions[1]
    i = [j for j, c in enumerate(call) if c.isdigit()][digit_at]
    return [actions[0], call[:i] + ("1" if call[i] != "1" else "2") + call[i + 1:], *actions[2:]]


@pytest.mark.parametrize("env_name, load", [("toy_chain", lambda s: load_tasks("toy_chain", n=20, seed=s)),
                                            ("chain_python", lambda s: load_tasks("chain_python", "train", n=20,
                                                                                  seed=s))])
def test_tasks_are_deterministic_per_seed_with_three_to_six_steps(env_name, load):
    a, b, c = load(3), load(3), load(4)
    assert [t.messages for t in a] == [t.messages for t in b] and [t.answer for t in a] == [t.answer for t in b]
    assert [t.messages for t in a] != [t.messages for t in c]
    refs = reference_actions_of(env_name)
    assert {len(refs(t)) - 1 for t in a} <= {3, 4, 5, 6} and len({len(refs(t)) for t in a}) > 1


def test_toy_chain_correct_chain_succeeds_and_a_wrong_step_shows_in_the_next_result():
    task = load_tasks("toy_chain", n=5, seed=1)[0]
    refs = tc.reference_actions(task)
    good = asyncio.run(_play("toy_chain", task, refs))
    nums, ops = task.meta["nums"], task.meta["ops"]
    assert [r.observation for r in good[:-1]] == [str(evaluate(nums[:k + 2], ops[:k + 1])) for k in range(len(ops))]
    assert good[-1].done and good[-1].reward == 1.0
    bad = asyncio.run(_play("toy_chain", task, _wrong_second_step(refs, 0)))
    assert bad[0].observation == good[0].observation  # the first step was right
    assert [r.observation for r in bad[1:-1]] == [tc.BROKEN] * (len(refs) - 2)  # broken from the wrong step on
    assert bad[-1].done and bad[-1].reward == 0.0 and bad[-1].info["reason"] == "broken_chain"


def test_toy_chain_demonstrations_replayed_earn_their_reward():
    demos = tc.make_demonstrations(40, seed=2, error_rate=0.5)
    tasks = tc.ToyChainTasks(40, seed=2)
    outcomes = set()
    for i, demo in enumerate(demos):
        actions = [m["content"] for m in demo if m["role"] == "assistant"]
        res = asyncio.run(_play("toy_chain", tasks[i], actions))
        tools = [m["content"] for m in demo if m["role"] == "tool"]
        assert [r.observation for r in res[:-1]] == tools  # the env answers exactly what the demo shows
        assert res[-1].reward == float(demo[-1]["content"] == f"={tasks[i].answer}" and tc.BROKEN not in tools)
        outcomes.add(res[-1].reward)
    assert outcomes == {0.0, 1.0}


def test_chain_python_splits_are_disjoint_by_content():
    key = lambda t: (t.meta["start"], tuple(map(tuple, t.meta["steps"])))  # noqa: E731
    held = {key(t) for t in load_tasks("chain_python", "eval", n=200, seed=0)}
    assert not held & {key(t) for t in load_tasks("chain_python", "train", n=1000, seed=1)}
    with pytest.raises(ValueError, match="env.train_data / env.eval_data"):
        load_tasks("chain_python", "test", n=3)


@pytest.mark.slow
def test_chain_python_runs_the_sandbox_and_breaks_the_chain_on_a_wrong_step():
    task = load_tasks("chain_python", "train", n=3, seed=5)[0]
    refs = cp.reference_actions(task)
    good = asyncio.run(_play("chain_python", task, refs))
    values = [task.meta["start"]]
    for op, b in task.meta["steps"]:
        values.append(eval(f"{values[-1]}{op}{b}"))  # the chain's arithmetic, by Python itself
    values = values[1:]
    assert [r.observation for r in good[:-1]] == [f"<tool_response>\n{v}\n</tool_response>" for v in values]
    assert good[-1].done and good[-1].reward == 1.0
    bad = asyncio.run(_play("chain_python", task, _wrong_second_step(refs, 0)))
    assert bad[0].observation == good[0].observation
    broken = f"<tool_response>\n{cp.BROKEN_MESSAGE}\n</tool_response>"
    assert [r.observation for r in bad[1:-1]] == [broken] * (len(refs) - 2)
    assert bad[-1].reward == 0.0 and bad[-1].info["reason"] == "broken_chain"
    two_steps = asyncio.run(_play("chain_python", task, ["<python>print(1)</python>\n<python>print(2)</python>"]))
    assert two_steps[0].observation == broken  # one step per call, one call per turn
