"""The SWE environment: generated tasks, grading in a fresh sandbox, the SWE-bench loader, mini-swe-agent's
shell over the sandbox, and one whole episode where mini-swe-agent (litellm, tool calls) fixes a bug through
the agent endpoint and the hidden tests pay 1."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest

from megatron_sao.envs import load_tasks
from megatron_sao.envs.sandbox import SandboxLimits, default_pool
from megatron_sao.envs.swe.generated import canonical, generate
from megatron_sao.envs.swe.grading import grade, parse_pytest_summary
from megatron_sao.envs.swe.library import MODULES
from megatron_sao.envs.swe.shell import SandboxShell
from megatron_sao.envs.swe.tasks import materialize
from megatron_sao.errors import UserError

LIMITS = SandboxLimits(wall_time_s=60.0, cpu_time_s=30, max_disk_mb=256, max_files=5000, max_processes=32)


def fixed_source(task) -> str:
    module = next(m for m in MODULES if f"sao_lib/{m.name}.py" in task.answer["files"])
    return "\n\n".join(canonical(f.source) for f in module.functions)


def test_generated_tasks_are_held_out_by_content_and_each_bug_breaks_a_test():
    train, held_out = generate("train"), generate("eval")
    assert len(train) >= 40 and len(held_out) >= 10
    assert not {t.task_id for t in train} & {t.task_id for t in held_out}
    for t in train + held_out:
        assert t.fail_to_pass and t.pass_to_pass and not set(t.fail_to_pass) & set(t.pass_to_pass)
        visible = next(v for k, v in t.files.items() if k.startswith("tests/test_"))
        assert all(f2p.rsplit(".", 1)[1] not in visible for f2p in t.fail_to_pass)  # hidden until grading
    tasks = load_tasks("swe", "eval")
    assert len(tasks) == len(held_out) and tasks[0].env == "swe" and "Bug report" in tasks[0].messages[0]["content"]


def test_grading_runs_the_hidden_tests_on_a_copy_of_the_repository(tmp_path):
    """The bug as injected earns 0 (its FAIL_TO_PASS tests fail, the others pass); the fix earns 1; and the
    agent's workspace is left as it was."""
    task = load_tasks("swe", "train")[0]

    async def go():
        src = tmp_path / "repo"
        src.mkdir()
        materialize(task, src)
        ws = await default_pool().open_workspace(src)
        try:
            broken = await grade(ws, task.answer, LIMITS)
            fix = next(k for k in task.answer["files"] if k.startswith("sao_lib/") and not k.endswith("__init__.py"))
            await ws.write_files({fix: fixed_source(task)})
            fixed = await grade(ws, task.answer, LIMITS)
            left = (await ws.shell("ls tests; cat tests/test_*.py | grep -c 'def test_'", LIMITS)).stdout
        finally:
            await ws.close()
        return broken, fixed, left
    broken, fixed, left = asyncio.run(go())
    assert broken.reward == 0.0 and broken.error is None, broken
    assert broken.fail_to_pass == 0 and broken.pass_to_pass == len(task.answer["pass_to_pass"])
    assert fixed.reward == 1.0 and fixed.fail_to_pass == len(task.answer["fail_to_pass"]), fixed
    assert int(left.split()[-1]) == len(task.answer["pass_to_pass"])  # the hidden tests went to the copy only


def test_the_shell_speaks_mini_swe_agent_s_environment_protocol(tmp_path):
    from minisweagent.exceptions import Submitted

    async def go():
        ws = await default_pool().open_workspace(None)
        shell = SandboxShell(ws, asyncio.get_running_loop(), SandboxLimits(wall_time_s=5.0, cpu_time_s=5))
        outs = []
        try:
            for cmd in ("echo hi; echo err >&2; exit 3", "sleep 30", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; "
                        "echo patch"):
                try:
                    outs.append(await asyncio.to_thread(shell.execute, {"command": cmd}))
                except Submitted as e:
                    outs.append(e.messages[0])
        finally:
            await ws.close()
        return outs, shell.get_template_vars()
    (plain, slow, submitted), tvars = asyncio.run(go())
    assert plain == {"output": "hi\nerr\n", "returncode": 3, "exception_info": ""}
    assert slow["returncode"] == -1 and "wall-clock limit" in slow["exception_info"]
    assert submitted["extra"] == {"exit_status": "Submitted", "submission": "patch\n"}
    assert {"cwd", "system", "machine"} <= set(tvars) and "PATH" not in tvars  # no trainer environment


def test_hostile_commands_from_the_harness_stay_in_the_sandbox(tmp_path):
    """mini-swe-agent's commands run as the trainer would run them: a host secret, a write outside, the
    network, the trainer's own process and a planted symlink all stay out of reach (every mode:
    test_sandbox_hostile.py's workspace cases)."""
    import os
    import socket

    secret = tmp_path / "answers.jsonl"
    secret.write_text("hunter2")
    outside = tmp_path / "pwned"
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.setblocking(False)
    port = srv.getsockname()[1]

    async def go():
        ws = await default_pool().open_workspace(None)
        shell = SandboxShell(ws, asyncio.get_running_loop(), LIMITS)
        cmds = [f"cat {secret}", f"echo x > {outside}", f"python3 -c \"import socket; socket.create_connection("
                f"('127.0.0.1', {port}), timeout=2)\"; echo rc=$?", f"kill -9 {os.getpid()}; echo rc=$?",
                "cat /proc/1/environ | tr '\\0' '\\n' | grep -c SAO_ || true", "ln -s /etc tests"]
        try:
            outs = [await asyncio.to_thread(shell.execute, {"command": c}) for c in cmds]
            await ws.write_files({"tests/test_x.py": "pass\n"})  # the host replaces the planted link
            inside = (await ws.shell("ls -la tests", LIMITS)).stdout
        finally:
            await ws.close()
        return outs, inside
    outs, inside = asyncio.run(go())
    assert "hunter2" not in outs[0]["output"] and outs[0]["returncode"] != 0
    assert not outside.exists()
    assert "rc=0" not in outs[2]["output"] and "rc=0" not in outs[3]["output"]
    with pytest.raises(BlockingIOError):
        srv.accept()
    assert "test_x.py" in inside and not Path("/etc/test_x.py").exists()
    srv.close()


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)


@pytest.fixture
def swebench_clone(tmp_path):
    """A git clone at <repos>/acme__calc with two commits; the instance's base is the first."""
    repo = tmp_path / "repos" / "acme__calc"
    repo.mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    base = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    (repo / "later.txt").write_text("not at the base commit")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "later")
    check = ("import calc\nfor name, ok in (('t.py::test_add', calc.add(2, 3) == 5), ('t.py::test_zero', "
             "calc.add(0, 0) == 0)):\n    print(('PASSED ' if ok else 'FAILED ') + name)\n")
    patch = ("diff --git a/t.py b/t.py\nnew file mode 100644\n--- /dev/null\n+++ b/t.py\n@@ -0,0 +1,"
             f"{len(check.splitlines())} @@\n" + "".join("+" + line + "\n" for line in check.splitlines()))
    row = {"instance_id": "acme__calc-1", "repo": "acme/calc", "base_commit": base,
           "problem_statement": "add() subtracts", "FAIL_TO_PASS": json.dumps(["t.py::test_add"]),
           "PASS_TO_PASS": ["t.py::test_zero"], "test_patch": patch, "test_cmd": "python3 t.py"}
    data = tmp_path / "instances.jsonl"
    data.write_text(json.dumps(row) + "\n")
    return data, tmp_path / "repos"


def test_swebench_instances_load_materialize_at_their_commit_and_grade(swebench_clone, tmp_path):
    data, repos = swebench_clone
    with pytest.raises(UserError, match="repos_dir"):
        load_tasks("swe", str(data))
    [task] = load_tasks("swe", str(data), repos_dir=str(repos))
    assert task.prompt_id == "swe/acme__calc-1" and task.answer["fail_to_pass"] == ["t.py::test_add"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"instance_id": "x", "repo": "acme/calc"}) + "\n")
    with pytest.raises(UserError, match=r"bad.jsonl:1: missing field"):
        load_tasks("swe", str(bad), repos_dir=str(repos))
    dest = tmp_path / "work"
    dest.mkdir()
    materialize(task, dest)
    assert (dest / "calc.py").exists() and not (dest / "later.txt").exists()
    log = subprocess.run(["git", "log", "--oneline"], cwd=dest, capture_output=True, text=True).stdout
    assert len(log.splitlines()) == 1  # a fresh one-commit repository: no history of the clone

    async def go():
        ws = await default_pool().open_workspace(dest)
        try:
            broken = await grade(ws, task.answer, LIMITS)
            await ws.write_files({"calc.py": "def add(a, b):\n    return a + b\n"})
            return broken, await grade(ws, task.answer, LIMITS)
        finally:
            await ws.close()
    broken, fixed = asyncio.run(go())
    assert broken.reward == 0.0 and broken.passed == {"t.py::test_add": False, "t.py::test_zero": True}, broken
    assert fixed.reward == 1.0, fixed
    assert parse_pytest_summary("PASSED a::b\nFAILED a::c - AssertionError\nERROR a::d") == {
        "a::b": True, "a::c": False, "a::d": False}


def test_mini_swe_agent_fixes_a_bug_through_the_endpoint_and_the_hidden_tests_pay(tmp_path):
    """A whole SWE episode with the real harness: mini-swe-agent's LitellmModel calls the agent endpoint
    (tool calls in the char template), its commands run in the sandbox, and grading in a fresh sandbox
    gives reward 1 for the fix the scripted policy writes."""
    from megatron_sao.envs import make_env
    from megatron_sao.rollout.agent_endpoint.episode import run_harness_episode
    from megatron_sao.rollout.agent_endpoint.server import AgentEndpoint
    from megatron_sao.rollout.chat import ChatFormatter
    from megatron_sao.rollout.engines.protocol import SamplingParams
    from megatron_sao.rollout.turns import AgentLoopConfig
    from megatron_sao.tokenizers import build_char_tokenizer
    from tests.agent_endpoint_fixtures import ScriptedTextEngine

    task = load_tasks("swe", "train")[0]
    path = next(k for k in task.answer["files"] if k.startswith("sao_lib/") and not k.endswith("__init__.py"))
    fix = f"cat > {path} <<'EOF'\n{fixed_source(task)}EOF\npython3 -m unittest -q 2>&1 | tail -1"

    def call(command: str) -> str:
        return "<tool_call>" + json.dumps({"name": "bash", "arguments": {"command": command}}) + "</tool_call>"
    tok = build_char_tokenizer()
    f = ChatFormatter(tok)
    engine = ScriptedTextEngine(tok, f.stop_token_ids[-1], [
        "Looking." + call(f"cat {path}"), call(fix), call("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")])
    cfg = AgentLoopConfig(max_turns=10, max_total_tokens=60_000, max_new_tokens_per_turn=4000,
                          sampling=SamplingParams(4000))

    async def go():
        ep = AgentEndpoint(f)
        await ep.start()
        try:
            env = make_env("swe", agent_config="compact", wall_limit_s=300)
            return await run_harness_episode(engine, env, task, ep, cfg)
        finally:
            await ep.stop()
    [traj] = asyncio.run(go())
    h = traj.info["harness"]
    assert traj.status == "terminated" and traj.reward == 1.0, (traj.error, traj.info)
    assert h["exit_status"] == "Submitted" and h["commands"] == 3 and h["model_calls"] == 3, h
    assert traj.info["rewrites"] == 0 and traj.num_turns == 3
    acts = [traj.tokens[s.start:s.end].tolist() for s in traj.spans if s.kind == "action"]
    assert acts == [r.token_ids for r in engine.results]
