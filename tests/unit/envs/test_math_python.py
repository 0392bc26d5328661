"""Math env: dataset loading in all formats, math-verify reward on AIME 2025, tool turns."""

import asyncio
import json
import threading

import pytest

from megatron_sao.envs.math_grading import grade_boxed
from megatron_sao.envs.math_python import MathPythonEnv, load_math_tasks
from tests.shared_data import shared_data_dir

DATA = shared_data_dir()


@pytest.mark.parametrize("name,n,first_id", [("aime25", 30, "aime25/0"), ("aime24", 30, "aime24/60"),
                                              ("math500", 500, None), ("gsm8k", 1319, "gsm8k_test/0")])
def test_load_all_formats(name, n, first_id):
    tasks = load_math_tasks(name, data_dir=DATA)
    assert len(tasks) == n
    t = tasks[0]
    assert t.env == "math_python" and t.messages[0]["role"] == "system" and "\\boxed" in t.messages[0]["content"]
    assert t.messages[1]["role"] == "user" and len(t.messages[1]["content"]) > 20
    if first_id:
        assert t.prompt_id == first_id
    if name == "gsm8k":
        assert t.answer == "18"  # the gold after '####', not the worked solution


def test_bad_dataset_inputs(tmp_path):
    with pytest.raises(ValueError, match="unknown math dataset"):
        load_math_tasks("aime99")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question_text": "x", "answer": 1}) + "\n")
    with pytest.raises(ValueError, match="needs a problem field"):
        load_math_tasks(str(bad))


def test_reward_on_aime25_answers():
    tasks = load_math_tasks("aime25", data_dir=DATA)
    golds = [t.answer for t in tasks]
    assert golds[0] == "70"
    for gold in golds:  # every gold is accepted in its own canonical form, and off-by-one is not
        assert grade_boxed(gold, gold).correct
        assert not grade_boxed(gold, str(int(gold) + 1)).correct
    for variant in ["70", "070", "70.0", "\\frac{140}{2}", "\\dfrac{140}{2}"]:
        assert grade_boxed("70", variant).correct, variant
    for wrong in ["71", "7", "-70", "\\text{seventy}", "70, 71"]:
        assert not grade_boxed("70", wrong).correct, wrong
    assert grade_boxed("70", None).reason == "no_answer"


def test_grading_works_off_the_main_thread():
    out = []
    th = threading.Thread(target=lambda: out.append(grade_boxed("588", "588").correct))
    th.start()
    th.join()
    assert out == [True]


def make_task(answer="70"):
    from megatron_sao.envs.base import Task
    return Task("t/0", [{"role": "user", "content": "q"}], answer, "math_python")


def run_episode(actions, answer="70"):
    async def main():
        env = MathPythonEnv(max_tool_calls=3)
        await env.reset(make_task(answer))
        results = []
        for a in actions:
            r = await env.step(a)
            results.append(r)
            if r.done:
                break
        await env.close()
        return results
    return asyncio.run(main())


def test_episode_tool_then_boxed_answer():
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(sum(range(5, 9)) + 44)"}}</tool_call>'
    r1, r2 = run_episode([call, "The result is \\boxed{070}"])
    assert not r1.done and r1.observation == "<tool_response>\n70\n</tool_response>"
    assert r1.info["tool_calls"] == 1
    assert r2.done and r2.reward == 1.0 and r2.info["tool_calls"] == 1 and r2.observation is None


def test_episode_wrong_answer_and_no_answer():
    (r,) = run_episode(["\\boxed{69}"])
    assert r.done and r.reward == 0.0 and r.info["reason"] == "wrong"
    (r,) = run_episode(["I think it is seventy."])
    assert r.done and r.reward == 0.0 and r.info["reason"] == "no_tool_call_or_answer"


def test_tool_errors_become_observations():
    (r,) = run_episode(['<tool_call>{"name": "shell", "arguments": {}}</tool_call>'])
    assert not r.done and "unknown tool 'shell'" in r.observation
    (r,) = run_episode(["<python>1/0</python>"])
    assert not r.done and "ZeroDivisionError" in r.observation and r.info["tool_errors"] == 1


def test_tool_call_limit_truncates():
    rs = run_episode(["<python>print(1)</python>"] * 5)
    assert len(rs) == 4 and rs[-1].done and rs[-1].info["truncated"] is True
