"""Arithmetic word problems with the Python tool: generator, content-disjoint splits, demonstrations, env."""

import asyncio
import json
import os
import re
import subprocess
import sys

import pytest

from megatron_sao.envs import load_tasks, make_env
from megatron_sao.envs.arith_python import (
    EVAL_FRACTION,
    KIND_BY_NAME,
    KINDS,
    SYSTEM_PROMPT,
    generate_problems,
    make_demonstrations,
    split_of,
)
from megatron_sao.envs.tool_calls import format_tool_response
from tests.paths import REPO

EXAMPLE = REPO / "examples" / "smollm2_arith.yaml"


def _key(row):
    return row["kind"], tuple(row["numbers"])


def test_generator_is_seeded_and_every_answer_is_the_story_s_value():
    a, b = generate_problems("train", 300, seed=3), generate_problems("train", 300, seed=3)
    assert a == b
    assert a != generate_problems("train", 300, seed=4)
    assert {r["kind"] for r in a} == {k.name for k in KINDS}
    for r in a:
        kind = KIND_BY_NAME[r["kind"]]
        assert r["answer"] == kind.value(*r["numbers"]) >= 0
        assert all(str(n) in r["question"] for n in r["numbers"])
        assert eval(r["expression"]) == r["answer"]  # noqa: S307 - our own digits and operators
    assert len({_key(r) for r in a}) == len(a)  # no problem twice


def test_max_ops_and_kinds_select_the_problem_shapes():
    assert {r["kind"] for r in generate_problems("train", 200, max_ops=1)} == {"add", "sub", "mul", "div"}
    assert {r["kind"] for r in generate_problems("eval", 50, kinds=["mul"])} == {"mul"}
    with pytest.raises(ValueError, match="unknown problem kinds"):
        generate_problems("train", 5, kinds=["pow"])
    with pytest.raises(ValueError, match="max_ops must be 1 or 2"):
        generate_problems("train", 5, max_ops=3)


def test_splits_are_disjoint_by_arithmetic_whatever_the_seeds():
    evals = {_key(r) for r in generate_problems("eval", 1500, seed=0)}
    for seed in (0, 1, 2):
        train = generate_problems("train", 6000, seed=seed)
        assert not evals & {_key(r) for r in train}
    assert all(split_of(k, n) == "eval" for k, n in evals)
    # the eval bucket is the advertised share of the problem space
    draws = [(k.name, k.draw(__import__("random").Random(i))) for i, k in enumerate(KINDS * 800)]
    share = sum(split_of(k, n) == "eval" for k, n in draws) / len(draws)
    assert abs(share - EVAL_FRACTION) < 0.03


def test_split_does_not_depend_on_the_process_hash_seed():
    code = ("import json; from megatron_sao.envs.arith_python import generate_problems as g; "
            "print(json.dumps([r['question'] for r in g('eval', 20, seed=5)]))")
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                           env={**os.environ, "PYTHONHASHSEED": s}).stdout
            for s in ("1", "2")]
    assert outs[0] == outs[1] and json.loads(outs[0])


def test_registry_loads_a_split_and_names_the_config_key_on_a_bad_one():
    tasks = load_tasks("arith_python", "eval", n=10, seed=0)
    assert len(tasks) == 10 and all(t.env == "arith_python" and t.prompt_id.startswith("arith/eval/") for t in tasks)
    assert tasks[0].messages[0] == {"role": "system", "content": SYSTEM_PROMPT}
    with pytest.raises(ValueError, match=r"env.train_data / env.eval_data"):
        load_tasks("arith_python", "test", n=10)


def test_the_example_config_trains_and_evaluates_on_disjoint_tasks():
    from megatron_sao.config import load_config
    from megatron_sao.trainer import components as C

    cfg = load_config(EXAMPLE)
    train, held_out = C.train_tasks(cfg), C.eval_tasks(cfg)
    assert len(held_out) == cfg.env.eval_size
    content = {(t.meta["kind"], tuple(t.meta["numbers"])) for t in train}
    assert not content & {(t.meta["kind"], tuple(t.meta["numbers"])) for t in held_out}
    # the same held-out set for every run seed: seeds vary only the RL phase
    other = C.eval_tasks(load_config(EXAMPLE, ["run.seed=2"]))
    assert [t.messages for t in other] == [t.messages for t in held_out]


def _parts(demo):
    call = re.fullmatch(r"<python>print\((.*)\)</python>", demo[2]["content"]).group(1)
    final = re.fullmatch(r"The answer is \\boxed\{(-?\d+)\}\.", demo[4]["content"]).group(1)
    return call, demo[3]["content"], int(final)


def test_demonstrations_are_consistent_and_flawed_at_the_requested_rate():
    gold = {r["question"]: r["answer"] for r in generate_problems("train", 2000, seed=7_919 + 0)}
    clean = make_demonstrations(200, seed=0, error_rate=0.0)
    for d in clean:
        call, tool, final = _parts(d)
        assert [m["role"] for m in d] == ["system", "user", "assistant", "tool", "assistant"]
        assert tool == format_tool_response(str(eval(call)))  # noqa: S307
        assert final == gold[d[1]["content"]]
    flawed = make_demonstrations(2000, seed=0, error_rate=0.6)
    wrong = 0
    for d in flawed:
        call, tool, final = _parts(d)
        assert tool == format_tool_response(str(eval(call)))  # the tool shows what the call really prints
        wrong += final != gold[d[1]["content"]]
    assert abs(wrong / len(flawed) - 0.6) < 0.05
    with pytest.raises(ValueError, match="error_rate"):
        make_demonstrations(3, error_rate=1.5)


def test_sft_stage_uses_the_env_s_demonstrations_with_the_config_s_error_rate():
    from megatron_sao.config import load_config
    from megatron_sao.trainer.sft import load_demonstrations

    cfg = load_config(EXAMPLE, ["sft.demonstrations=50", "sft.error_rate=0.0"])
    demos = load_demonstrations(cfg)
    assert demos == make_demonstrations(50, seed=cfg.run.seed, error_rate=0.0, max_ops=2)


@pytest.mark.slow
def test_demonstrations_replayed_in_the_env_earn_their_reward():
    """The real sandbox prints what the demonstration's tool message says; reward 1 iff not flawed."""
    demos = make_demonstrations(6, seed=1, error_rate=0.5)
    gold = {r["question"]: r["answer"] for r in generate_problems("train", 6, seed=7_919 + 1)}

    async def play(demo):
        env = make_env("arith_python")
        task = load_tasks("arith_python", "train", n=1)[0]
        task.answer = str(gold[demo[1]["content"]])
        await env.reset(task)
        first = await env.step(demo[2]["content"])
        last = await env.step(demo[4]["content"])
        await env.close()
        return first, last

    for demo in demos:
        first, last = asyncio.run(play(demo))
        assert not first.done and first.observation == demo[3]["content"]
        assert last.done and last.reward == float(_parts(demo)[2] == gold[demo[1]["content"]])
    assert any(_parts(d)[2] != gold[d[1]["content"]] for d in demos)  # both outcomes were exercised
    assert any(_parts(d)[2] == gold[d[1]["content"]] for d in demos)
