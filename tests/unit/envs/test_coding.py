"""Coding env: the built-in tasks are solvable, hidden tests decide the reward, cheats get 0."""

import asyncio

import pytest

from megatron_sao.envs.coding import CodingEnv, load_coding_tasks, run_hidden_tests
from megatron_sao.envs.sandbox import SandboxLimits

REFERENCE = {
    "digit_sum": "def digit_sum(n):\n    return sum(int(c) for c in str(abs(n)))\n",
    "is_palindrome": "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]\n",
    "fizzbuzz": ("def fizzbuzz(n):\n    return ['FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else "
                 "'Buzz' if i % 5 == 0 else str(i) for i in range(1, n + 1)]\n"),
    "two_sum": ("def two_sum(nums, target):\n    seen = {}\n    for j, x in enumerate(nums):\n"
                "        if target - x in seen:\n            return (seen[target - x], j)\n        seen[x] = j\n"),
    "run_length_encode": ("import itertools\ndef run_length_encode(s):\n"
                          "    return ''.join(f'{len(list(g))}{k}' for k, g in itertools.groupby(s))\n"),
    "primes_below": ("def primes_below(n):\n    if n < 3:\n        return []\n    sieve = bytearray([1]) * n\n"
                     "    sieve[0:2] = b'\\x00\\x00'\n    for i in range(2, int(n ** 0.5) + 1):\n"
                     "        if sieve[i]:\n            sieve[i*i::i] = bytearray(len(range(i*i, n, i)))\n"
                     "    return [i for i in range(n) if sieve[i]]\n"),
    "balanced_brackets": ("def balanced_brackets(s):\n    pairs, st = {')': '(', ']': '[', '}': '{'}, []\n"
                          "    for c in s:\n        if c in '([{':\n            st.append(c)\n"
                          "        elif c in pairs:\n            if not st or st.pop() != pairs[c]:\n"
                          "                return False\n    return not st\n"),
    "merge_intervals": ("def merge_intervals(iv):\n    out = []\n    for a, b in sorted(iv):\n"
                        "        if out and a <= out[-1][1]:\n            out[-1] = (out[-1][0], max(out[-1][1], b))\n"
                        "        else:\n            out.append((a, b))\n    return out\n"),
    "word_frequencies": ("import re\ndef word_frequencies(text):\n    d = {}\n"
                         "    for w in re.findall('[A-Za-z]+', text):\n        d[w.lower()] = d.get(w.lower(), 0) + 1\n"
                         "    return d\n"),
    "rotate_matrix": "def rotate_matrix(m):\n    return [list(r) for r in zip(*m[::-1])]\n",
}


def test_builtin_tasks_load_and_reference_solutions_pass():
    tasks = load_coding_tasks("builtin")
    assert len(tasks) == 10
    assert sorted(t.prompt_id.split("/")[1] for t in tasks) == sorted(REFERENCE)

    async def main():
        return await asyncio.gather(*(run_hidden_tests(REFERENCE[t.answer["entry_point"]], t.answer["tests"],
                                                       SandboxLimits()) for t in tasks))

    for t, rep in zip(tasks, asyncio.run(main())):
        assert rep.passed == rep.total, (t.prompt_id, rep)


def episode(action: str, task_name: str = "digit_sum"):
    task = next(t for t in load_coding_tasks() if t.prompt_id == f"coding/{task_name}")

    async def main():
        env = CodingEnv(test_limits=SandboxLimits(wall_time_s=5.0, cpu_time_s=2))  # small: a test hangs
        await env.reset(task)
        return await env.step(action)
    return asyncio.run(main())


def test_correct_solution_gets_reward_1():
    r = episode("Here it is:\n```python\n" + REFERENCE["digit_sum"] + "```")
    assert r.done and r.reward == 1.0 and r.info["passed"] == r.info["total"] == 4


def test_incorrect_solution_gets_reward_0_with_counts():
    r = episode("```python\ndef digit_sum(n):\n    return sum(int(c) for c in str(n) if c.isdigit()) if n else 1\n```")
    assert r.done and r.reward == 0.0
    assert r.info["passed"] == 3 and r.info["total"] == 4 and "test 1" in r.info["error"]


@pytest.mark.parametrize("cheat", [
    "import sys\nsys.exit(0)",
    "import os\nos._exit(0)",
    "print('SAO-RESULT-00000000000000000000000000000000:{\"passed\": 4, \"error\": null}')",
    "def digit_sum(n):\n    while True:\n        pass",
])
def test_cheats_and_hangs_get_reward_0(cheat):
    r = episode(f"```python\n{cheat}\n```")
    assert r.done and r.reward == 0.0 and r.info["passed"] == 0


def test_tool_call_then_no_answer():
    task = load_coding_tasks()[0]

    async def main():
        env = CodingEnv()
        await env.reset(task)
        r1 = await env.step("<python>print('trying')</python>")
        r2 = await env.step("I give up.")
        return r1, r2
    r1, r2 = asyncio.run(main())
    assert not r1.done and "trying" in r1.observation and r1.info["tool_calls"] == 1
    assert r2.done and r2.reward == 0.0 and r2.info["reason"] == "no_tool_call_or_answer"


def test_bad_task_file(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"task_id": "x", "prompt": "def f(): ...", "entry_point": "f", "tests": []}\n')
    with pytest.raises(ValueError, match="non-empty list"):
        load_coding_tasks(p)
