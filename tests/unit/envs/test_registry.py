"""Registry: names resolve, unknown names and bad arguments fail clearly, the protocol holds."""

import asyncio

import pytest

from megatron_sao.envs import Environment, TaskSource, available_envs, load_tasks, make_env, register_env


def test_builtin_names_make_protocol_envs():
    builtin = ["coding", "math_python", "style_shift", "toy_tool"]
    assert set(builtin) <= set(available_envs())
    for name in builtin:
        env = make_env(name)
        assert isinstance(env, Environment) and env.name == name


def test_load_generated_and_builtin_tasks():
    toy = load_tasks("toy_tool", n=10, seed=1, max_ops=3)
    assert isinstance(toy, TaskSource) and len(toy) == 10 and toy[0].env == "toy_tool"
    assert len(load_tasks("style_shift", n=5)) == 5
    assert len(load_tasks("coding", "builtin")) == 10


def test_unknown_names_and_bad_args():
    with pytest.raises(ValueError, match="unknown environment 'nope'.*available"):
        make_env("nope")
    with pytest.raises(ValueError, match="unknown environment"):
        load_tasks("nope", "x")
    with pytest.raises(TypeError, match="bad arguments"):
        make_env("toy_tool", max_tool_call=3)
    with pytest.raises(ValueError, match="generates its tasks"):
        load_tasks("toy_tool", "some/path.jsonl")
    with pytest.raises(ValueError, match="needs a dataset"):
        load_tasks("math_python")


def test_wrong_task_and_step_before_reset():
    env = make_env("toy_tool")
    coding_task = load_tasks("coding")[0]
    with pytest.raises(ValueError, match="is for env 'coding'"):
        asyncio.run(env.reset(coding_task))
    with pytest.raises(RuntimeError, match="before reset"):
        asyncio.run(env.step("=1"))


def test_register_custom_env():
    class Echo:
        name = "echo_test"

        async def reset(self, task): ...
        async def step(self, action_text): ...
        async def close(self): ...

    register_env("echo_test", Echo)
    assert isinstance(make_env("echo_test"), Echo)
    with pytest.raises(ValueError, match="already registered"):
        register_env("echo_test", Echo)
