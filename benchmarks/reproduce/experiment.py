"""What every experiment shares: settings, the trajectory budget, run construction, curve loading."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.reproduce.runner import Run, RunResult, execute_all
from benchmarks.reproduce.starts import Start
from benchmarks.reproduce.summary import Curves, curves_of

_PRINT_LOCK = threading.Lock()


@dataclass(frozen=True)
class Budget:
    """Equal trajectory budget: every method consumes `steps * batch` trajectories (SAO's critic
    warm-up steps included: they use rollouts too, so SAO gets `warmup` fewer actor steps)."""

    batch: int
    steps: int
    eval_every: int
    eval_size: int
    warmup: int

    @property
    def trajectories(self) -> int:
        return self.batch * self.steps


FULL = Budget(batch=32, steps=20, eval_every=5, eval_size=200, warmup=2)
QUICK = Budget(batch=8, steps=2, eval_every=2, eval_size=8, warmup=1)


@dataclass
class Settings:
    name: str
    quick: bool
    seeds: list[int]
    jobs: int
    out: Path  # results folder (committed): results.md, summary.json, *.png
    work: Path  # run directories and starting points (not committed)
    fresh: bool = False
    command: str = ""
    max_runs: int | None = None  # experiments with per-run result files: train at most this many missing runs
    rows: list[str] | None = None  # ... and only the missing runs of these rows (None: every row)
    model: str = "toy"  # --model: toy | smollm2 (the main comparison and the online experiment)
    task: str = "arith"  # --model smollm2: the recipe's task (smollm2_main.TASKS)
    stress: bool = False  # dynamics: the stress regime (dynamics.STRESS)
    switch_every: int | None = None  # online: trainer steps per phase (None: online.FULL_SWITCH / QUICK_SWITCH)
    actor_lr: float | None = None  # online: the actor's LR, the critic's at the paper's ratio (None: the recipe's)
    entropy_coef: float | None = None  # online: algorithm.entropy_coef (None: the recipe's, no entropy bonus)
    t0: float = field(default_factory=time.time)

    @property
    def budget(self) -> Budget:
        return QUICK if self.quick else FULL

    @property
    def elapsed_s(self) -> float:
        return time.time() - self.t0

    def log(self, msg: str) -> None:
        with _PRINT_LOCK:  # runs report from worker threads
            print(f"[{self.name} {time.time() - self.t0:6.0f}s] {msg}", flush=True)


# Method definitions: overrides on top of the starting point's config. GRPO uses n=4 rollouts per
# prompt, so at equal trajectories it sees a quarter of the prompts. "grpo" is the paper's vanilla
# GRPO (PPO ratio against the learner's own log-probs: no staleness correction); the suite compares
# that one. "grpo_rollout_ratio" (ratio against the rollout log-probs) is the variant the suite ran
# before, kept for comparison with the earlier results.
METHODS: dict[str, tuple[str, ...]] = {
    "grpo": ("algorithm.name=grpo", "algorithm.group_size=4"),
    "grpo_rollout_ratio": ("algorithm.name=grpo_rollout_ratio", "algorithm.group_size=4"),
    "grpo_dis": ("algorithm.name=grpo_dis", "algorithm.group_size=4"),
    "sao": ("algorithm.name=sao",),
    "running_mean": ("algorithm.name=running_mean",),
}


def rl_run(s: Settings, start: Start, label: str, seed: int, method: str, extra: tuple[str, ...] = (),
           budget: Budget | None = None) -> Run:
    b = budget or s.budget
    uses_critic = method == "sao"
    warmup = b.warmup if uses_critic else 0
    overrides = (*start.rl_overrides(b.eval_size), *METHODS[method],
                 f"algorithm.critic_warmup_steps={warmup}", f"run.total_steps={b.steps - warmup}",
                 f"buffer.batch_size={b.batch}", f"parallel.micro_batch_size={b.batch}",
                 f"rollout.concurrency={2 * b.batch}", f"run.eval_every={b.eval_every}", *extra)
    return Run(label, seed, start.config, overrides)


def run_and_load(s: Settings, runs: list[Run], batch: int,
                 start_eval: float | None) -> tuple[list[RunResult], dict[str, list[Curves]]]:
    """Execute (or reuse) `runs`; curves grouped by label in first-seen order. Failed runs are kept
    in the results (the report lists them) and left out of the curves."""
    results = execute_all(runs, s.work, jobs=s.jobs, fresh=s.fresh, log=s.log)
    groups: dict[str, list[Curves]] = {}
    for r in results:
        groups.setdefault(r.run.label, [])
        if r.ok:
            groups[r.run.label].append(curves_of(r, batch, start_eval))
    return results, groups


def failures(results: list[RunResult]) -> list[str]:
    return [f"{r.run.label} seed {r.run.seed}: failed, log {r.dir}" for r in results if not r.ok]


def finish(s: Settings, md: str, results: list[RunResult], common: tuple[str, ...], data: dict) -> int:
    """The end every experiment shares: the runs' exact settings and any failed run appended to the
    markdown, results.md + summary.json written; returns the exit code (1 if a run failed)."""
    from benchmarks.reproduce.report import runs_section, write_report

    md += runs_section(results, common)
    fails = failures(results)
    if fails:
        md += "\n**Failed runs**\n\n" + "\n".join(f"- {f}" for f in fails) + "\n"
    write_report(s.out, md, {**data, "failed": fails,
                             "runs": {f"{r.run.label}/s{r.run.seed}": str(r.dir) for r in results}})
    return 1 if fails else 0
