"""SWE task sources: the generated repositories, and SWE-bench-format instances for clusters with the repositories.

``load_swe_tasks(spec)``:

* ``"train"`` / ``"eval"``: the generated tasks (envs/swe/generated.py), disjoint by content;
* a ``.jsonl`` / ``.json`` path: SWE-bench instances (the fields of ``princeton-nlp/SWE-bench``:
  ``instance_id``, ``repo`` ("owner/name"), ``base_commit``, ``problem_statement``, ``FAIL_TO_PASS`` and
  ``PASS_TO_PASS`` (lists, or JSON strings of lists), ``test_patch``; optional ``test_cmd``, the shell
  command that runs the tests and prints pytest's ``-rA`` summary (default: ``python -m pytest -rA`` on the
  files the test patch touches). Each repository must be a git clone at ``<repos_dir>/<owner>__<name>``
  (``repos_dir``: the loader's argument or $SAO_SWE_REPOS); a missing one is named at load time.

A task's ``answer`` (never shown to the agent) says how to build its repository and how to grade it;
``materialize(task, dest)`` writes the repository into ``dest`` on the host: the generated files, or the
clone's tree at ``base_commit`` (``git archive``, so no history and no other branch comes along) as a fresh
one-commit git repository, so the agent's ``git diff`` shows its own changes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from megatron_sao.envs.base import ListTaskSource, Task
from megatron_sao.envs.swe.generated import SPLITS, generate
from megatron_sao.errors import UserError

ENV_NAME = "swe"
_REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS")
_DIFF_FILE = re.compile(r"^\+\+\+ b/(\S+)", re.MULTILINE)


def load_swe_tasks(path_or_spec: str | None = None, repos_dir: str | None = None, limit: int | None = None
                   ) -> ListTaskSource:
    spec = path_or_spec or "train"
    if spec in SPLITS:
        tasks = [_generated_task(t) for t in generate(spec)]
    else:
        tasks = _swebench_tasks(Path(spec), repos_dir or os.environ.get("SAO_SWE_REPOS", ""))
    return ListTaskSource(tasks[:limit] if limit is not None else tasks)


def _generated_task(t) -> Task:
    return Task(prompt_id=f"swe/{t.task_id}", messages=[{"role": "user", "content": t.problem_statement}],
                answer={"kind": "generated", "runner": "unittest", "files": dict(t.files),
                        "hidden_tests": dict(t.hidden_tests), "fail_to_pass": list(t.fail_to_pass),
                        "pass_to_pass": list(t.pass_to_pass)},
                env=ENV_NAME, meta={"source": "generated", "bug": f"{t.bug.operator}{t.bug.site}"})


def _id_list(row: dict, key: str, where: str) -> list[str]:
    v = row[key]
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            raise UserError(f"{where}: {key} is a string that is not a JSON list") from None
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise UserError(f"{where}: {key} must be a list of test ids")
    return v


def _swebench_tasks(path: Path, repos_dir: str) -> list[Task]:
    if not path.exists():
        raise UserError(f"SWE task file not found: {path} (env.train_data: 'train', 'eval' or a SWE-bench jsonl)")
    text = path.read_text("utf-8")
    rows = json.loads(text) if path.suffix == ".json" else [json.loads(x) for x in text.splitlines() if x.strip()]
    if not repos_dir:
        raise UserError(f"{path}: SWE-bench instances need their repositories: pass repos_dir "
                        "(env.task_kwargs.repos_dir) or set $SAO_SWE_REPOS to a directory of git clones")
    tasks = []
    for i, row in enumerate(rows, 1):
        where = f"{path}:{i}"
        missing = [k for k in _REQUIRED if k not in row]
        if missing:
            raise UserError(f"{where}: missing field(s) {missing}")
        clone = Path(repos_dir) / row["repo"].replace("/", "__")
        if not (clone / ".git").exists() and not (clone / "HEAD").exists():
            raise UserError(f"{where}: no git clone of {row['repo']} at {clone}")
        patch = row.get("test_patch") or ""
        test_cmd = row.get("test_cmd") or ("python -m pytest -rA -p no:cacheprovider "
                                           + " ".join(sorted(set(_DIFF_FILE.findall(patch)))))
        tasks.append(Task(
            prompt_id=f"swe/{row['instance_id']}", messages=[{"role": "user", "content": row["problem_statement"]}],
            answer={"kind": "swebench", "runner": "pytest", "clone": str(clone), "base_commit": row["base_commit"],
                    "test_patch": patch, "test_cmd": test_cmd, "fail_to_pass": _id_list(row, "FAIL_TO_PASS", where),
                    "pass_to_pass": _id_list(row, "PASS_TO_PASS", where)},
            env=ENV_NAME, meta={"source": str(path), "repo": row["repo"]}))
    return tasks


def materialize(task: Task, dest: Path) -> None:
    """Write ``task``'s repository into the empty directory ``dest`` (host side, trusted data)."""
    answer = task.answer
    if answer["kind"] == "generated":
        for rel, text in answer["files"].items():
            p = dest / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        return
    archive = subprocess.run(["git", "-C", answer["clone"], "archive", "--format=tar", answer["base_commit"]],
                             capture_output=True, check=False)
    if archive.returncode != 0:
        raise RuntimeError(f"git archive {answer['base_commit']} of {answer['clone']} failed: "
                           f"{archive.stderr.decode(errors='replace')[-500:]}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True, capture_output=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(dest), "GIT_CONFIG_NOSYSTEM": "1"}
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.name=sao", "-c", "user.email=sao@localhost", "commit", "-qm", "base"]):
        subprocess.run(cmd, cwd=dest, env=env, check=True, capture_output=True)
