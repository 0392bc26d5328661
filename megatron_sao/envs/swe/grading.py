"""Grading a SWE task after its agent stopped: the hidden tests, in a fresh sandbox, decide the reward.

``grade`` forks the agent's workspace (a copy of the repository as the agent left it: nothing the agent
still runs can touch it), writes the hidden test files over it (removing whatever the agent put at those
paths), runs the FAIL_TO_PASS and PASS_TO_PASS tests and reads one result per test. The reward is
SWE-bench's "resolved": 1.0 iff every FAIL_TO_PASS and every PASS_TO_PASS test passes, else 0.0.

Two test runners:

* ``unittest`` (the generated tasks): one sandbox call whose code runs each test id with the standard
  library's unittest and prints the results on a line tagged with a per-call random nonce, the test
  output itself captured; a repository that exits the interpreter at import (``os._exit(0)``) prints no
  result line and earns 0, as in ``envs/coding.py`` (code running in that process could still find the
  nonce by inspecting frames: out of scope, as there).
* ``pytest`` (SWE-bench instances): the instance's test patch applied with ``git apply``, then its test
  command (``python -m pytest -rA`` on the test files by default) as a shell command, and pytest's
  ``-rA`` summary lines (``PASSED <id>``, ``FAILED <id> - ...``, ``ERROR <id>``) read per test id; a
  test id without a line counts as failed. Repositories whose harness is not pytest need their own
  ``test_cmd`` printing the same summary.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from megatron_sao.envs.sandbox import SandboxLimits, SandboxWorkspace

_UNITTEST_RUNNER = '''
import io, json, os, sys, unittest
sys.path.insert(0, os.getcwd())
_out, _nonce, _ids = sys.stdout, {nonce!r}, {ids!r}
sys.stdout = sys.stderr = io.StringIO()  # the repository's prints must not reach the result channel
_results = {{}}
for _id in _ids:
    try:
        _suite = unittest.defaultTestLoader.loadTestsFromName(_id)
        _r = unittest.TestResult()
        _suite.run(_r)
        _results[_id] = _r.testsRun == 1 and _r.wasSuccessful()
    except BaseException:
        _results[_id] = False
_out.write("\\n" + _nonce + json.dumps(_results) + "\\n")
_out.flush()
'''
_PYTEST_LINE = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\s+(\S+)")


@dataclass
class GradeReport:
    reward: float
    passed: dict[str, bool] = field(default_factory=dict)
    fail_to_pass: int = 0  # how many FAIL_TO_PASS tests pass
    pass_to_pass: int = 0
    error: str | None = None  # why no test result could be read

    def info(self, f2p: list[str], p2p: list[str]) -> dict:
        return {"reward": self.reward, "fail_to_pass": f"{self.fail_to_pass}/{len(f2p)}",
                "pass_to_pass": f"{self.pass_to_pass}/{len(p2p)}", "grade_error": self.error}


def resolved(passed: dict[str, bool], f2p: list[str], p2p: list[str], error: str | None = None) -> GradeReport:
    n_f2p = sum(bool(passed.get(t)) for t in f2p)
    n_p2p = sum(bool(passed.get(t)) for t in p2p)
    ok = error is None and n_f2p == len(f2p) and n_p2p == len(p2p)
    return GradeReport(1.0 if ok else 0.0, passed, n_f2p, n_p2p, error)


def parse_pytest_summary(text: str) -> dict[str, bool]:
    """Test id -> passed, from pytest's ``-rA`` short summary (a later line about an id wins)."""
    out: dict[str, bool] = {}
    for line in text.splitlines():
        m = _PYTEST_LINE.match(line.strip())
        if m:
            out[m.group(2)] = m.group(1) in ("PASSED", "XFAIL")
    return out


async def run_unittest(ws: SandboxWorkspace, test_ids: list[str], limits: SandboxLimits) -> tuple[dict, str | None]:
    nonce = "SAO-GRADE-" + secrets.token_hex(16) + ":"
    res = await ws.run(_UNITTEST_RUNNER.format(nonce=nonce, ids=list(test_ids)), limits)
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(nonce):
            return {str(k): bool(v) for k, v in json.loads(line[len(nonce):]).items()}, None
    return {}, res.killed_reason or f"no test result (exit status {res.exit_code})"


async def run_pytest(ws: SandboxWorkspace, test_patch: str, test_cmd: str, limits: SandboxLimits
                     ) -> tuple[dict, str | None]:
    if test_patch:
        await ws.write_files({".sao_test.patch": test_patch})
        applied = await ws.shell("git apply --whitespace=nowarn .sao_test.patch && rm .sao_test.patch", limits)
        if applied.exit_code != 0:
            return {}, f"the test patch does not apply: {applied.stdout[-500:]}"
    res = await ws.shell(test_cmd, limits)
    if res.killed_reason is not None:
        return parse_pytest_summary(res.stdout), f"the tests were stopped: {res.killed_reason}"
    return parse_pytest_summary(res.stdout), None


async def grade(agent_ws: SandboxWorkspace, answer: dict, limits: SandboxLimits) -> GradeReport:
    """The task's reward (module docstring) for the repository in ``agent_ws`` as it is now."""
    f2p, p2p = list(answer["fail_to_pass"]), list(answer["pass_to_pass"])
    ws = await agent_ws.fork()
    try:
        if answer["runner"] == "unittest":
            await ws.write_files(answer["hidden_tests"])
            passed, error = await run_unittest(ws, f2p + p2p, limits)
        else:
            passed, error = await run_pytest(ws, answer.get("test_patch", ""), answer["test_cmd"], limits)
        return resolved(passed, f2p, p2p, error)
    finally:
        await ws.close()
