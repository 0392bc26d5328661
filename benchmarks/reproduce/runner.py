"""Run `sao` stages as subprocesses, cached by what they compute, a few at a time.

A `Run` is one `sao train` (or sft / value-pretrain) invocation: a config file plus dotted overrides.
Its directory name carries a hash of the config file's content (its parsed YAML: a comment edited in a
recipe does not orphan the runs it has), the overrides, the stage and the trainer's
`ALGORITHM_VERSION` (megatron_sao/trainer/step.py: a code change that alters what the same config
computes bumps it, so such a change never reuses old runs), so two
experiments that need the same run (the SAO reference of the main comparison and of the ablations)
share it, and re-running an experiment only runs what is missing. A run counts as done when its
stage wrote its final artefact (`final_model/` for train); a half-finished directory is deleted and
run again, never read.

Why subprocesses: each stage builds its own Megatron world (torch.distributed, parallel state),
exactly as a user's `sao train` does; two runs never share a process.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from megatron_sao.config.strict_yaml import load_strict

ROOT = Path(__file__).resolve().parents[2]
LOAD_SAMPLE_S = 10.0  # how often a run samples the machine's load average

DONE_MARKER = {"train": "final_model/config.json", "sft": "sft_model/config.json",
               "value-pretrain": "critic_pretrained/config.json"}


@dataclass(frozen=True)
class Run:
    label: str  # method / variant name shown in tables
    seed: int
    config: str  # YAML path (relative to the repo root or absolute)
    overrides: tuple[str, ...] = ()
    stage: str = "train"
    run_dir: str | None = None  # a fixed directory (a starting point: sft then value-pretrain in one dir)

    def key(self) -> str:
        path = Path(self.config) if Path(self.config).is_absolute() else ROOT / self.config
        content = load_strict(path.read_text())
        h = hashlib.sha256(json.dumps([self.stage, content, sorted(self.overrides), self.seed,
                                       algorithm_version()], sort_keys=True, default=str).encode())
        return h.hexdigest()[:10]

    def directory(self, work: Path) -> Path:
        if self.run_dir is not None:
            return Path(self.run_dir)
        return work / "runs" / f"{self.label}-s{self.seed}-{self.key()}"


@dataclass
class RunResult:
    run: Run
    dir: Path
    ok: bool
    wall_s: float
    cached: bool
    error: str = ""
    load_avg: float | None = None  # the machine's mean 1-min load average while it ran (wall times need it)
    cpu_s: float | None = None  # CPU seconds of the run's process tree (_wait_cpu_seconds)

    @property
    def t_start(self) -> float:
        return json.loads(_info_path(self.run, self.dir).read_text())["t_start"]

    def metrics(self) -> list[dict]:
        p = self.dir / "metrics.jsonl"
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def algorithm_version() -> int:
    from megatron_sao.trainer.step import ALGORITHM_VERSION  # on use: the trainer's imports are heavy

    return ALGORITHM_VERSION


def _info_path(run: Run, d: Path) -> Path:
    return d / f"reproduce_{run.stage}.json"


def _done(run: Run, d: Path) -> bool:
    return (d / DONE_MARKER[run.stage]).exists() and _info_path(run, d).exists()


def _wait_cpu_seconds(p: subprocess.Popen, every_sample: Callable[[], None]) -> float:
    """Wait for ``p`` (calling ``every_sample`` each LOAD_SAMPLE_S meanwhile); its CPU seconds, user and
    system, with those of the processes it waited for (its torchrun ranks, its vLLM EngineCore): the
    figure that, unlike the wall time, a shared machine does not inflate."""
    waited, t_next = 0, time.monotonic() + LOAD_SAMPLE_S
    while not waited:
        waited, status, usage = os.wait4(p.pid, os.WNOHANG)
        if not waited:
            time.sleep(min(0.5, max(0.0, t_next - time.monotonic())))
            if time.monotonic() >= t_next:
                every_sample()
                t_next += LOAD_SAMPLE_S
    p.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime


def execute(run: Run, work: Path, threads: int = 1, fresh: bool = False, log=print) -> RunResult:
    d = run.directory(work)
    if _done(run, d) and not fresh:
        info = json.loads(_info_path(run, d).read_text())
        return RunResult(run, d, True, info["wall_s"], cached=True, load_avg=info.get("load_avg"),
                         cpu_s=info.get("cpu_s"))
    if d.exists() and run.run_dir is None:  # an interrupted or failed attempt: never read half-written results
        shutil.rmtree(d)
    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "megatron_sao.cli", run.stage, run.config, f"run.dir={d}", f"run.seed={run.seed}",
           "run.console=none", *run.overrides]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    log(f"  start {run.stage:14s} {d.name}")
    t0 = time.time()
    log_path = d / f"{run.stage}.log"
    loads: list[float] = []  # this machine may be shared: a wall time means little without its load
    with open(log_path, "w") as out:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        cpu_s = _wait_cpu_seconds(p, lambda: loads.append(os.getloadavg()[0]))
    wall = time.time() - t0
    load = round(sum(loads) / len(loads), 2) if loads else round(os.getloadavg()[0], 2)
    if p.returncode != 0 or not (d / DONE_MARKER[run.stage]).exists():
        tail = log_path.read_text()[-3000:]
        log(f"  FAILED {d.name} (exit {p.returncode}); log: {log_path}")
        return RunResult(run, d, False, wall, cached=False, error=tail, load_avg=load, cpu_s=cpu_s)
    if run.stage == "train":  # optimizer state is not needed afterwards: keep metrics and final_model only
        shutil.rmtree(d / "checkpoints", ignore_errors=True)
    _info_path(run, d).write_text(json.dumps({"command": cmd, "t_start": t0, "wall_s": wall, "cpu_s": cpu_s,
                                              "label": run.label,
                                              "seed": run.seed, "threads": threads, "load_avg": load,
                                              "algorithm_version": algorithm_version()}, indent=1))
    log(f"  done  {run.stage:14s} {d.name} in {wall:.0f} s (mean load average {load:g})")
    return RunResult(run, d, True, wall, cached=False, load_avg=load, cpu_s=cpu_s)


def execute_all(runs: list[Run], work: Path, jobs: int = 1, fresh: bool = False, log=print,
                on_done: Callable[[RunResult], None] | None = None) -> list[RunResult]:
    """Run (or reuse) every run; `jobs` at a time, the machine's cores split between them.
    `on_done(result)` is called as each run ends (from its worker thread), so a caller can record a
    finished run at once rather than after the slowest one."""
    unique = list(dict.fromkeys(runs))
    threads = max(1, (os.cpu_count() or 1) // max(jobs, 1))

    def one(r: Run) -> RunResult:
        res = execute(r, work, threads, fresh, log)
        if on_done is not None:
            on_done(res)
        return res

    with ThreadPoolExecutor(max(jobs, 1)) as pool:
        results = list(pool.map(one, unique))
    by_run = dict(zip(unique, results))
    return [by_run[r] for r in runs]
