"""Function-writing tasks with hidden unit tests run in the sandbox; reward 1 iff all tests pass.

Task schema (one JSON object per line, see ``data/coding_tasks.jsonl``)::

    {"task_id": str, "prompt": str (signature + docstring), "entry_point": str,
     "tests": [str, ...]}   # each test is Python source, usually one assert

Turn semantics mirror ``math_python``: tool calls run first (the policy may try its code), else a
fenced ```python block is the final answer and is graded, else the episode ends with reward 0.

Grading runs the solution and then each test in one sandbox process and reads a result line
tagged with a per-call random nonce. The solution's own output is captured, so it cannot print
a fake result line, and exiting early (``sys.exit(0)``, ``os._exit``) yields no result line, i.e.
reward 0. Code running in the same process could still find the nonce by inspecting frames; a
policy that learns that is out of scope here (run tests in a separate process to close it).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from megatron_sao.envs.base import ListTaskSource, StepResult, Task
from megatron_sao.envs.python_tool import TOOL_INSTRUCTIONS, PythonToolEnv
from megatron_sao.envs.sandbox import SandboxLimits, SandboxPool, run_python
from megatron_sao.envs.tool_calls import extract_python_block

ENV_NAME = "coding"
SYSTEM_PROMPT = (
    "You are an expert Python programmer. Implement the requested function.\n"
    + TOOL_INSTRUCTIONS
    + "\nWhen you are done, give the complete final solution (imports included) in one "
      "```python code block."
)
_REQUIRED = {"task_id": str, "prompt": str, "entry_point": str, "tests": list}

_RUNNER = '''
import io, json, sys, traceback
_out, _nonce = sys.stdout, {nonce!r}
_solution, _tests = {solution!r}, {tests!r}

def _report(passed, error):
    _out.write("\\n" + _nonce + json.dumps({{"passed": passed, "error": error}}) + "\\n")
    _out.flush()

sys.stdout = io.StringIO()  # the solution's prints must not reach the result channel
_ns = {{"__name__": "solution"}}
try:
    exec(compile(_solution, "solution.py", "exec"), _ns)
except BaseException as e:
    _report(0, "solution failed to load: " + "".join(traceback.format_exception_only(type(e), e)).strip())
else:
    _passed, _first_error = 0, None
    for _i, _t in enumerate(_tests):
        try:
            exec(compile(_t, "test_%d" % _i, "exec"), dict(_ns))
            _passed += 1
        except BaseException as e:
            if _first_error is None:
                _first_error = "test %d: %s" % (_i, ("".join(traceback.format_exception_only(type(e), e)).strip()))
    _report(_passed, _first_error)
'''


def load_coding_tasks(path: str | Path | None = None, limit: int | None = None) -> ListTaskSource:
    """Load tasks of the schema above; ``None`` or ``"builtin"`` loads the bundled set of 10."""
    if path is None or str(path) == "builtin":
        text = resources.files("megatron_sao.envs").joinpath("data/coding_tasks.jsonl").read_text("utf-8")
        where = "builtin coding_tasks.jsonl"
    else:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"coding task file not found: {p}")
        text, where = p.read_text("utf-8"), str(p)
    tasks: list[Task] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        for key, typ in _REQUIRED.items():
            if not isinstance(row.get(key), typ):
                raise ValueError(f"{where}:{lineno}: field {key!r} must be a {typ.__name__}")
        if not row["tests"] or not all(isinstance(t, str) for t in row["tests"]):
            raise ValueError(f"{where}:{lineno}: 'tests' must be a non-empty list of strings")
        tasks.append(Task(
            prompt_id=f"coding/{row['task_id']}",
            messages=[{"role": "system", "content": SYSTEM_PROMPT},
                      {"role": "user", "content": "Implement this function:\n\n" + row["prompt"]}],
            answer={"entry_point": row["entry_point"], "tests": row["tests"]},
            env=ENV_NAME, meta={"source": where}))
        if limit is not None and len(tasks) >= limit:
            break
    return ListTaskSource(tasks)


@dataclass
class HiddenTestReport:
    passed: int
    total: int
    error: str | None  # first failure, or why nothing ran


async def run_hidden_tests(solution: str, tests: list[str], limits: SandboxLimits,
                           pool: SandboxPool | None = None) -> HiddenTestReport:
    """Run ``tests`` against ``solution`` in one sandbox call."""
    nonce = "SAO-RESULT-" + secrets.token_hex(16) + ":"
    res = await run_python(_RUNNER.format(nonce=nonce, solution=solution, tests=tests), limits, pool)
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(nonce):
            data = json.loads(line[len(nonce):])
            return HiddenTestReport(int(data["passed"]), len(tests), data["error"])
    why = res.killed_reason or f"no test result (exit status {res.exit_code})"
    return HiddenTestReport(0, len(tests), why)


@dataclass
class CodingEnv(PythonToolEnv):
    """One coding trajectory; reward 1 iff every hidden test passes."""

    test_limits: SandboxLimits = field(default_factory=lambda: SandboxLimits(wall_time_s=30.0, cpu_time_s=20))
    name: str = ENV_NAME

    def check_task(self, task: Task) -> None:
        if not isinstance(task.answer, dict) or not isinstance(task.answer.get("tests"), list):
            raise ValueError(f"{self.name}: task {task.prompt_id!r} needs answer={{'tests': [...]}}")

    async def answer(self, task: Task, action_text: str) -> StepResult:
        solution = extract_python_block(action_text)
        if solution is None:
            return StepResult(None, True, 0.0, self._info(reason="no_tool_call_or_answer"))
        rep = await run_hidden_tests(solution, task.answer["tests"], self.test_limits, self.pool)
        ok = rep.passed == rep.total
        return StepResult(None, True, float(ok), self._info(
            reason="all_tests_passed" if ok else "tests_failed", passed=rep.passed, total=rep.total,
            error=rep.error))
