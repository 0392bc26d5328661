"""Math with a Python tool (AIME style): tool calls run in the sandbox, ``\\boxed{}`` ends the episode.

Turn semantics (``MathPythonEnv.step``):
* the turn has tool calls -> they run (even if the turn also has a ``\\boxed{}``: the policy asked
  to compute something, so its answer is not final yet) and their output is the observation;
* else it has a ``\\boxed{}`` -> graded by math-verify, reward 1/0, episode over;
* else -> episode over with reward 0 (``reason = "no_tool_call_or_answer"``).
More than ``max_tool_calls`` calls in an episode ends it as truncated (``info["truncated"]``).

Datasets: jsonl or jsonl.gz rows in the formats of /work/shared/data (see SOURCES.md there):
problem text in ``problem`` or ``question``; gold in ``answer`` (GSM8K keeps its worked solution
there, the gold is after ``####``); id in ``id``, ``unique_id`` or ``idx``.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

from megatron_sao.envs.base import ListTaskSource, StepResult, Task
from megatron_sao.envs.math_grading import grade_boxed_async
from megatron_sao.envs.python_tool import TOOL_INSTRUCTIONS, PythonToolEnv
from megatron_sao.envs.tool_calls import extract_boxed

ENV_NAME = "math_python"
SYSTEM_PROMPT = (
    "You are an expert competition mathematician. Reason step by step.\n"
    + TOOL_INSTRUCTIONS
    + "\nWhen you are sure, write the final answer once as \\boxed{answer}."
)
KNOWN_DATASETS = {"aime24": "aime24.jsonl", "aime25": "aime25.jsonl",
                  "math500": "math500.jsonl", "gsm8k": "gsm8k_test.jsonl.gz"}


@dataclass(frozen=True)
class MathFieldMap:
    """Which row fields hold the problem, the gold answer and the id (first present key wins)."""

    problem: tuple[str, ...] = ("problem", "question")
    answer: tuple[str, ...] = ("answer",)
    id: tuple[str, ...] = ("id", "unique_id", "idx")


def _first(row: dict, keys: tuple[str, ...]):
    for k in keys:
        if k in row and row[k] is not None:
            return row[k]
    return None


def _gold(raw) -> str:
    text = str(raw).strip()
    if "####" in text:  # GSM8K: worked solution, then "#### 18"
        text = text.rsplit("####", 1)[1].strip().replace(",", "")
    return text


def resolve_math_dataset(path_or_name: str, data_dir: str | os.PathLike | None = None) -> Path:
    """A file path, or a known short name (``aime25``...) looked up in ``data_dir`` / $SAO_DATA_DIR."""
    p = Path(path_or_name)
    if p.suffix in (".jsonl", ".gz") or p.exists():
        if not p.exists():
            raise FileNotFoundError(f"math dataset file not found: {p}")
        return p
    if path_or_name not in KNOWN_DATASETS:
        raise ValueError(f"unknown math dataset {path_or_name!r}: give a .jsonl/.jsonl.gz path or one of "
                         f"{sorted(KNOWN_DATASETS)}")
    root = data_dir or os.environ.get("SAO_DATA_DIR")
    if root is None:
        raise ValueError(f"dataset {path_or_name!r} is a short name: pass data_dir= or set $SAO_DATA_DIR")
    p = Path(root) / KNOWN_DATASETS[path_or_name]
    if not p.exists():
        raise FileNotFoundError(f"math dataset {path_or_name!r} not found at {p}")
    return p


def load_math_tasks(path_or_name: str, data_dir: str | os.PathLike | None = None,
                    fields: MathFieldMap = MathFieldMap(), limit: int | None = None,
                    system_prompt: str = SYSTEM_PROMPT) -> ListTaskSource:
    """Load math tasks from a jsonl(.gz) file; rows missing a problem or answer are an error."""
    if not path_or_name:
        raise ValueError("load_tasks('math_python') needs a dataset path or name, e.g. 'aime25'")
    path = resolve_math_dataset(path_or_name, data_dir)
    opener = gzip.open if path.suffix == ".gz" else open
    stem = path.name.split(".")[0]
    tasks: list[Task] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            problem, answer = _first(row, fields.problem), _first(row, fields.answer)
            if problem is None or answer is None:
                raise ValueError(f"{path}:{lineno}: needs a problem field {fields.problem} and an "
                                 f"answer field {fields.answer}; row has {sorted(row)}")
            rid = _first(row, fields.id)
            tasks.append(Task(
                prompt_id=f"{stem}/{rid if rid is not None else lineno - 1}",
                messages=[{"role": "system", "content": system_prompt},
                          {"role": "user", "content": str(problem)}],
                answer=_gold(answer), env=ENV_NAME, meta={"source": str(path)}))
            if limit is not None and len(tasks) >= limit:
                break
    if not tasks:
        raise ValueError(f"no tasks in {path}")
    return ListTaskSource(tasks)


@dataclass
class MathPythonEnv(PythonToolEnv):
    """One math trajectory with a sandboxed Python tool; reward 1 iff the boxed answer is right."""

    grading_timeout_s: float = 10.0
    name: str = ENV_NAME

    async def answer(self, task: Task, action_text: str) -> StepResult:
        boxed = extract_boxed(action_text)
        if boxed is None:
            return StepResult(None, True, 0.0, self._info(reason="no_tool_call_or_answer"))
        grade = await grade_boxed_async(str(task.answer), boxed, self.grading_timeout_s)
        return StepResult(None, True, float(grade.correct), self._info(reason=grade.reason, pred=boxed))
