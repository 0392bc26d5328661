"""Run `sao` stages as subprocesses, cached by what they compute, a few at a time.

A `Run` is one `sao train` (or sft / value-pretrain) invocation: a config file plus dotted overrides.
Its directory name carries a hash of the config file's content (its parsed YAML: a comment edited in a
recipe does not orphan the runs it has), the overrides, the stage and the trainer's
`ALGORITHM_VERSION` (megatron_sao/trainer/step.py: a code change that alters what the same config
computes bumps it, so such a change never reuses old runs), so two
experiments that need the same run (the SAO reference of the main comparison and of the ablations)
share it, and re-running an experiment only runs what is missing. A run counts as done when its
stage wrote its final artefact (`final_model/` for train); a half-finished directory is deleted and
run again, never read, unless the run checkpoints (`Run.checkpoint_every`, the SmolLM2 experiments'
hour-long runs): then the next invocation resumes it from its newest intact checkpoint (`sao train
--resume`, which truncates the logs to that step) and its wall and CPU time add up every attempt's,
the work redone since the checkpoint included (`reproduce_train.attempts.json` in the run directory).

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
from functools import cached_property
from pathlib import Path

import psutil

from megatron_sao.config.strict_yaml import load_strict

ROOT = Path(__file__).resolve().parents[2]
LOAD_SAMPLE_S = 10.0  # how often a run samples the machine's load average
# Trainer steps between the checkpoints of the hour-long runs (SmolLM2), from which a run killed with its
# session resumes: at most that many steps are trained twice.
CHECKPOINT_EVERY = 10
LEFTOVER_GRACE_S = 10.0  # how long a run's leftover processes may take to exit on their own (_kill_leftovers)

# What makes a stage compute the same bits on any x86-64 machine with AVX2, AVX-512 ones included: ATen's
# AVX2 kernels instead of the widest this CPU has (their reductions group the sums by vector width), MKL's
# conditional numerical reproducibility mode on its AVX2 path, and a fixed thread count (both split the work
# by thread). Measured on the word problems' SFT (docs/results.md, section 10): AVX-512 and AVX2 kernels give
# different weights, and with this an AVX-512 machine gives the AVX2 ones (one build each: 150 s against 140 s;
# the scalar kernels with MKL_CBWR=COMPATIBLE took 280-295 s). For the shared starting points of the experiments
# spread over sessions: every session is a fresh machine that rebuilds the start, and result files are keyed by
# its weights.
PORTABLE_NUMERICS = (("ATEN_CPU_CAPABILITY", "avx2"), ("MKL_CBWR", "AVX2"))
PORTABLE_THREADS = 2

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
    # Trainer steps between checkpoints (0: none), so that an interrupted train run resumes. Not part of
    # key(): checkpoints decide where a run can pick up, not what it computes.
    checkpoint_every: int = 0
    # Environment variables of the stage process (PORTABLE_NUMERICS), part of key() when given: they
    # change the bits it computes.
    env: tuple[tuple[str, str], ...] = ()

    def key(self) -> str:
        path = Path(self.config) if Path(self.config).is_absolute() else ROOT / self.config
        content = load_strict(path.read_text())
        what = [self.stage, content, sorted(self.overrides), self.seed, algorithm_version()]
        if self.env:  # only then: the runs without one keep their keys
            what.append(sorted(self.env))
        h = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode())
        return h.hexdigest()[:10]

    def command_overrides(self) -> tuple[str, ...]:
        """The overrides its `sao` command gets: `overrides`, with `run.save_every` set to
        `checkpoint_every` when it checkpoints."""
        if not self.checkpoint_every:
            return self.overrides
        return (*(o for o in self.overrides if not o.startswith("run.save_every=")),
                f"run.save_every={self.checkpoint_every}")

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
    attempts: int = 1  # invocations the run took: more than one when it was resumed from a checkpoint

    @cached_property
    def _tries(self) -> list[dict]:
        """Its attempts (t_start, wall_s), read once; a run that never checkpointed had one."""
        attempts = _attempts_path(self.run, self.dir)
        if attempts.exists():
            return json.loads(attempts.read_text())
        return [{"t_start": json.loads(_info_path(self.run, self.dir).read_text())["t_start"], "wall_s": self.wall_s}]

    def elapsed(self, wall_time: float) -> float:
        """Seconds of the run's own time at clock time `wall_time` (a logged step's): since it started,
        less the gaps between its attempts when it was resumed."""
        tries = self._tries
        i = max([0] + [k for k, a in enumerate(tries) if a["t_start"] <= wall_time])  # the attempt that logged it
        return sum(a["wall_s"] for a in tries[:i]) + wall_time - tries[i]["t_start"]

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


def _attempts_path(run: Run, d: Path) -> Path:
    return d / f"reproduce_{run.stage}.attempts.json"


def _tree(root: int) -> list[psutil.Process]:
    """`root` and its live descendants ([] once it has ended)."""
    try:
        proc = psutil.Process(root)
        return [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _kill_leftovers(seen: dict[int, psutil.Process], grace_s: float) -> list[str]:
    """Kill the descendants of an ended stage process that still run `grace_s` later (psutil checks each is
    the same process, not a reused pid); their names. A trainer the kernel's OOM killer or a signal ended
    leaves its vLLM engine (EngineCore and its worker, a few GiB) orphaned, and the next run, short of that
    memory, died the same way (seen: three SmolLM2 runs in a row). The grace lets a clean exit's helpers
    (multiprocessing's resource tracker, which unlinks leaked shared memory) finish on their own."""
    _, still = psutil.wait_procs([proc for proc in seen.values() if proc.is_running()], timeout=grace_s)
    killed = []
    for proc in still:
        try:
            name = proc.name()
            proc.kill()
            killed.append(f"{name} (pid {proc.pid})")
        except psutil.NoSuchProcess:
            pass
    return killed


def _tree_cpu_seconds(procs: list[psutil.Process]) -> float:
    """CPU seconds so far, user and system, of a process tree (`_tree`), with what each has reaped of its
    children: a running attempt's cost, which wait4 gives only at its end."""
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:  # ended meanwhile: its parent has reaped it (counted there) or will
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def _attempt(pid: int, t_start: float, wall_s: float, cpu_s: float, loads: list[float],
             exit_code: int | None) -> dict:
    """One invocation of a run (`pid`: its stage process). `exit` None: still running, or killed before it
    ended with its harness (the figures are then its last sample's, at most LOAD_SAMPLE_S old)."""
    return {"pid": pid, "t_start": t_start, "wall_s": wall_s, "cpu_s": cpu_s, "load_samples": len(loads),
            "load_avg": sum(loads) / len(loads), "exit": exit_code}


def _still_running(attempt: dict, d: Path) -> bool:
    """Whether an attempt without an exit status outlived its harness: its stage process, training in `d`."""
    try:
        cmdline = Path(f"/proc/{attempt['pid']}/cmdline").read_bytes().split(b"\0")
    except (OSError, KeyError):
        return False
    return attempt["exit"] is None and f"run.dir={d}".encode() in cmdline


def _totals(attempts: list[dict]) -> tuple[float, float, float]:
    """A run's wall and CPU seconds over its attempts, and the machine's mean load while they ran."""
    samples = sum(a["load_samples"] for a in attempts)  # every attempt has at least one
    return (sum(a["wall_s"] for a in attempts), sum(a["cpu_s"] for a in attempts),
            round(sum(a["load_avg"] * a["load_samples"] for a in attempts) / samples, 2))


def _write_attempts(d: Path, run: Run, attempts: list[dict]) -> None:
    from megatron_sao.trainer.checkpoints import atomic_write_text  # on use: it imports torch

    # all or nothing: a kill mid-write leaves the previous record, never half of one
    atomic_write_text(_attempts_path(run, d), json.dumps(attempts, indent=1))


def stage_command(run: Run, d: Path, resume: bool) -> list[str]:
    return [sys.executable, "-m", "megatron_sao.cli", run.stage, *(["--resume"] if resume else []), run.config,
            f"run.dir={d}", f"run.seed={run.seed}", "run.console=none", *run.command_overrides()]


def execute(run: Run, work: Path, threads: int = 1, fresh: bool = False, log=print) -> RunResult:
    d = run.directory(work)
    if _done(run, d) and not fresh:
        info = json.loads(_info_path(run, d).read_text())
        return RunResult(run, d, True, info["wall_s"], cached=True, load_avg=info.get("load_avg"),
                         cpu_s=info.get("cpu_s"), attempts=info.get("attempts", 1))
    # An earlier attempt of a checkpointing run: resumed (the trainer falls back to a fresh start if it
    # left no intact checkpoint). Any other half-finished directory is deleted: never read half-written results.
    resume = (not fresh and run.checkpoint_every > 0 and run.run_dir is None
              and _attempts_path(run, d).exists())
    if d.exists() and run.run_dir is None and not resume:
        shutil.rmtree(d)
    d.mkdir(parents=True, exist_ok=True)
    cmd = stage_command(run, d, resume)
    earlier = json.loads(_attempts_path(run, d).read_text()) if resume else []
    if earlier and _still_running(earlier[-1], d):
        raise RuntimeError(f"{d}: its previous attempt (pid {earlier[-1]['pid']}) is still training there; "
                           "stop it or wait for it before running this again")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", **dict(run.env)}
    log(f"  {'resume' if resume else 'start'} {run.stage:14s} {d.name}"
        + (f" (attempt {len(earlier) + 1})" if resume else ""))
    t0 = time.time()
    log_path = d / f"{run.stage}.log"
    loads: list[float] = []  # this machine may be shared: a wall time means little without its load
    seen: dict[int, psutil.Process] = {}  # every descendant the samples found, killed if left running

    def every_sample() -> None:
        loads.append(os.getloadavg()[0])
        tree = _tree(p.pid)
        seen.update((proc.pid, proc) for proc in tree[1:])
        if run.checkpoint_every:  # what this attempt has cost so far, should it be killed before it ends
            _write_attempts(d, run, [*earlier, _attempt(p.pid, t0, time.time() - t0, _tree_cpu_seconds(tree), loads,
                                                        None)])

    with open(log_path, "a" if resume else "w") as out:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        cpu_s = _wait_cpu_seconds(p, every_sample)
    wall_s = time.time() - t0
    left = _kill_leftovers(seen, LEFTOVER_GRACE_S)
    if left:
        log(f"  {d.name} (exit {p.returncode}) left running: {', '.join(left)}; killed")
    attempts = [*earlier, _attempt(p.pid, t0, wall_s, cpu_s, loads or [os.getloadavg()[0]], p.returncode)]
    if run.checkpoint_every:
        _write_attempts(d, run, attempts)
    wall, cpu_s, load = _totals(attempts)
    if p.returncode != 0 or not (d / DONE_MARKER[run.stage]).exists():
        tail = log_path.read_text()[-3000:]
        log(f"  FAILED {d.name} (exit {p.returncode}); log: {log_path}")
        return RunResult(run, d, False, wall, cached=False, error=tail, load_avg=load, cpu_s=cpu_s,
                         attempts=len(attempts))
    if run.stage == "train":  # optimizer state is not needed afterwards: keep metrics and final_model only
        shutil.rmtree(d / "checkpoints", ignore_errors=True)
    _info_path(run, d).write_text(json.dumps({"command": cmd, "t_start": attempts[0]["t_start"], "wall_s": wall,
                                              "cpu_s": cpu_s, "attempts": len(attempts), "label": run.label,
                                              "seed": run.seed, "threads": threads, "env": dict(run.env),
                                              "load_avg": load, "algorithm_version": algorithm_version()}, indent=1))
    log(f"  done  {run.stage:14s} {d.name} in {wall:.0f} s (mean load average {load:g}"
        + (f", {len(attempts)} attempts)" if len(attempts) > 1 else ")"))
    return RunResult(run, d, True, wall, cached=False, load_avg=load, cpu_s=cpu_s, attempts=len(attempts))


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
