"""Per-run result files in results/: what a finished run computed, committed with the repository so
an experiment spread over sessions (and checkouts, whose runs/ folders are not shared) skips the
runs already done.

A run's file is `<label>-s<seed>-<key>.json`. The key hashes what the run computes: the runner's
`Run.key` (config content, overrides, seed, stage, `ALGORITHM_VERSION`) with its starting point's
weights by content instead of by path, since another checkout builds the same starting point
somewhere else, and a rebuilt one that came out different must not count as the same start. A file
whose key the current configuration does not produce is never read as a result; `stale` lists them
so a report can say they were set aside.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.reproduce.report import git_commit
from benchmarks.reproduce.runner import Run, RunResult, algorithm_version, execute_all
from benchmarks.reproduce.summary import curves_of
from megatron_sao.checkpoint.digest import dir_digest

START_PLACEHOLDER = "<start>"


def weights_digest(model_dir: Path) -> str:
    """sha256 over every file of an HF model directory (names and bytes, in name order)."""
    return dir_digest(model_dir)


def sft_and_critic_digest(start) -> str:
    """What a run from a `starts.Start` (SFT model and value-pretrained critic) starts from, by content."""
    return weights_digest(start.sft_model) + weights_digest(start.critic)


def portable_overrides(overrides: tuple[str, ...], start_dir: Path) -> tuple[str, ...]:
    """The overrides with the starting point's directory written as a placeholder."""
    return tuple(o.replace(str(start_dir), START_PLACEHOLDER) for o in overrides)


def portable(run: Run, start_dir: Path) -> Run:
    """The run with its starting point's directory written as a placeholder: the same run, wherever
    the starting point lies."""
    return replace(run, overrides=portable_overrides(run.overrides, start_dir))


def result_key(run: Run, start_dir: Path, start_digest: str) -> str:
    key = portable(run, start_dir).key()  # includes ALGORITHM_VERSION
    return hashlib.sha256(json.dumps([key, start_digest]).encode()).hexdigest()[:12]


def result_path(folder: Path, run: Run, key: str) -> Path:
    return folder / f"{run.label}-s{run.seed}-{key}.json"


def load(path: Path, key: str) -> dict | None:
    """The result stored at `path`, None if there is none. A file whose content does not match its
    name (edited by hand, or written by other code) is an error, never silently used or replaced."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if data.get("key") != key or data.get("algorithm_version") != algorithm_version():
        raise ValueError(f"{path}: holds key {data.get('key')} / ALGORITHM_VERSION {data.get('algorithm_version')}, "
                         f"its name and this code say {key} / {algorithm_version()}; delete the file to run it again")
    return data


def write(path: Path, data: dict) -> None:
    """Atomically: a reader (or a killed writer) never leaves half a result behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    tmp.replace(path)


def stale(folder: Path, current: dict[Run, Path]) -> list[str]:
    """Result files in `folder` of these runs (by label and seed) that the current configuration does
    not produce (another config, ALGORITHM_VERSION or starting point). Files of other seeds are not
    this invocation's business and are not listed."""
    names = {p.name for p in current.values()}
    prefixes = tuple(f"{r.label}-s{r.seed}-" for r in current)
    return sorted(p.name for p in folder.glob("*.json") if p.name.startswith(prefixes) and p.name not in names)


def _finite(x: float) -> float | None:
    return None if x is None or math.isnan(x) else x


def summarize(result: RunResult, batch: int) -> dict:
    """Everything a report needs from a finished run, so that the report never reads runs/ again:
    held-out accuracy by trajectories consumed and wall time, per-step reward and diagnostics, the
    histogram of trajectory lags (policy versions behind the trainer when trained on), wall time and
    throughput. `trajectories_per_s` counts the run's wall time less its held-out evaluations."""
    c = curves_of(result, batch)
    rows = result.metrics()
    eval_s = sum(float(r.get("time/eval_s", 0.0)) for r in rows)
    lags: Counter[int] = Counter()
    for r in rows:
        for lag, n in (r.get("lag_histogram") or {}).items():
            lags[int(lag)] += int(n)
    evals = sorted((result.dir / "eval").glob("step_*.jsonl"))
    n_eval = sum(1 for line in evals[-1].read_text().splitlines() if line.strip()) if evals else 0
    trajectories = c.trajectories[-1] if c.trajectories else 0
    train_s = result.wall_s - eval_s
    return {"wall_s": result.wall_s, "cpu_s": result.cpu_s, "load_avg": result.load_avg, "eval_s": eval_s,
            "attempts": result.attempts,
            "trajectories": trajectories,
            "trajectories_per_s": trajectories / train_s if train_s > 0 else None,
            "n_eval": n_eval, "eval_points": [[n, t, _finite(acc)] for n, t, acc in c.eval_points],
            "steps": c.steps, "trajectories_per_step": c.trajectories, "wall_s_per_step": c.wall_s,
            "reward": [_finite(v) for v in c.reward],
            "series": {k: [_finite(v) for v in vs] for k, vs in c.series.items()},
            "lag_histogram": {str(k): lags[k] for k in sorted(lags)}}


@dataclass
class Recorded:
    """The runs of an experiment with per-run result files, after an invocation: `done[run]` the result
    (None: still missing), the runs that failed in this invocation, and the files set aside (`stale`)."""

    done: dict[Run, dict | None]
    failed: list[RunResult]
    stale: list[str]

    @property
    def missing(self) -> list[Run]:
        return [r for r, d in self.done.items() if d is None]

    def summary(self) -> dict:
        return bookkeeping(list(self.done), self.done, self.failed, self.stale)


def bookkeeping(runs: list[Run], done: dict, failed: list[RunResult], stale_files: list[str]) -> dict:
    """The summary.json fields every experiment with per-run result files writes: whether every run is
    done, which are missing, failed in this invocation or set aside, and every finished run's result."""
    missing = [r for r in runs if done[r] is None]
    return {"complete": not missing, "missing": [f"{r.label}/s{r.seed}" for r in missing],
            "failed": [f"{f.run.label}/s{f.run.seed}: log {f.dir}" for f in failed], "stale": stale_files,
            "results": {f"{r.label}/s{r.seed}": done[r] for r in runs if done[r] is not None}}


def train_missing(s, runs: list[Run], start_dir: Path, digest: Callable[[Run], str], start_info: Callable[[Run], dict],
                  batch: int, jobs: int = 1, also: Callable[[Run], list[str]] = lambda run: []) -> Recorded:
    """Train the runs of `runs` that have no result file in `s.out`/runs/ (all of them with `s.fresh`), at
    most `s.max_runs` of them and only those of the rows `s.rows` when set, and write each one's result
    file the moment it finishes: an experiment spread over sessions keeps every run it finished.

    `digest(run)` identifies the weights the run starts from (part of its key), `start_info(run)` is
    what its result file says about them; `also(run)`: other starting points whose result counts for the
    run too (a stage that is not bit-reproducible, drawn again in another session: the caller says so in
    its report), tried after `digest(run)`'s. `s` is the experiment's Settings."""
    folder = s.out / "runs"
    keys = {r: result_key(r, start_dir, digest(r)) for r in runs}  # what a run trained now is filed under
    found = {r: next((k for k in (keys[r], *(result_key(r, start_dir, o) for o in also(r)))
                      if result_path(folder, r, k).exists()), keys[r]) for r in runs}  # where its result is read
    paths = {r: result_path(folder, r, keys[r]) for r in runs}
    read = {r: result_path(folder, r, found[r]) for r in runs}
    done = {r: load(read[r], found[r]) for r in runs}
    missing = [r for r in runs if s.fresh or done[r] is None]
    todo = [r for r in missing if s.rows is None or r.label in s.rows]
    todo = todo if s.max_runs is None else todo[: s.max_runs]
    s.log(f"{len(runs) - len(missing)} of {len(runs)} runs have a result in {folder}; training {len(todo)} now")
    failed: list[RunResult] = []
    commit = git_commit()  # the code the runs start from: a commit made while they train is not theirs

    def record(res: RunResult) -> None:
        if not res.ok:
            failed.append(res)
            return
        data = {"experiment": s.name, "label": res.run.label, "seed": res.run.seed, "key": keys[res.run],
                "algorithm_version": algorithm_version(), "config": res.run.config,
                "overrides": list(portable(res.run, start_dir).overrides), "start": start_info(res.run),
                "batch": batch, "commit": commit, "run_dir": str(res.dir), **summarize(res, batch)}
        write(paths[res.run], data)
        done[res.run], read[res.run] = data, paths[res.run]
        s.log(f"  result {paths[res.run]}")

    execute_all(todo, s.work, jobs=jobs, fresh=s.fresh, log=s.log, on_done=record)
    return Recorded(done, failed, stale(folder, read))
