"""From a run's metrics.jsonl to the curves and numbers the tables and plots show (pure functions)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from benchmarks.reproduce.runner import RunResult


@dataclass
class Curves:
    """Per trainer step (warm-up steps included: they consume trajectories too)."""

    label: str
    seed: int
    batch: int
    steps: list[int] = field(default_factory=list)
    trajectories: list[int] = field(default_factory=list)  # consumed after this step
    wall_s: list[float] = field(default_factory=list)  # since the run's process started
    reward: list[float] = field(default_factory=list)
    eval_points: list[tuple[int, float, float]] = field(default_factory=list)  # (trajectories, wall_s, accuracy)
    series: dict[str, list[float]] = field(default_factory=dict)  # any other logged scalar, NaN when absent
    run_wall_s: float = 0.0

    def final_eval(self) -> float:
        return self.eval_points[-1][2] if self.eval_points else math.nan

    def last_fraction_mean(self, key: str, fraction: float = 0.25) -> float:
        xs = self.reward if key == "reward" else self.series.get(key, [])
        xs = [x for x in xs[-max(1, int(len(xs) * fraction)):] if not math.isnan(x)]
        return sum(xs) / len(xs) if xs else math.nan


SERIES_KEYS = ("actor/kept_fraction", "actor/ess", "actor/clip_fraction", "critic/grad_norm/attention",
               "critic/grad_norm/moe", "critic/explained_variance", "actor/grad_norm", "version",
               "rollout/policy_step_min")


def curves_of(result: RunResult, batch: int, start_eval: float | None = None) -> Curves:
    """`start_eval`: the starting point's accuracy, plotted at 0 trajectories."""
    c = Curves(result.run.label, result.run.seed, batch, run_wall_s=result.wall_s)
    if start_eval is not None:
        c.eval_points.append((0, 0.0, start_eval))
    rows = result.metrics()
    # Every critic diagnostic the run logged (EV overall and by turn, value mean, value error, loss, grad
    # norms of the trained groups and the head) and the return it is compared with, per step.
    critic = sorted({k for row in rows for k in row if k.startswith("critic/") or k == "return_mean"})
    for row in rows:
        n = (row["step"] + 1) * batch
        c.steps.append(row["step"])
        c.trajectories.append(n)
        c.wall_s.append(result.elapsed(row["wall_time"]))
        c.reward.append(row["reward"])
        for k in dict.fromkeys([*SERIES_KEYS, *critic]):
            c.series.setdefault(k, []).append(float(row.get(k, math.nan)))
        if "eval/accuracy" in row:
            c.eval_points.append((n, result.elapsed(row["wall_time"]), row["eval/accuracy"]))
    return c


@dataclass
class Stat:
    mean: float
    std: float
    values: list[float]

    def fmt(self, digits: int = 3) -> str:
        if not self.values or all(math.isnan(v) for v in self.values):
            return "n/a"
        if len(self.values) == 1:  # one seed has no spread to show
            return f"{self.mean:.{digits}f} (one seed)"
        vals = ", ".join(f"{v:.{digits}f}" for v in self.values)
        return f"{self.mean:.{digits}f} ± {self.std:.{digits}f} ({vals})"


def stat(values: list[float]) -> Stat:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return Stat(math.nan, math.nan, list(values))
    return Stat(statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0, list(values))


def paired_delta(runs: list[Curves], reference: list[Curves], value=lambda c: c.final_eval()) -> Stat:
    """Per-seed differences `value(run) - value(reference run of the same seed)`. Runs of one seed share
    the starting point, the prompt order and the sampler's seed, so their outcomes are correlated and
    a paired difference is the fairer comparison than two independent means."""
    ref = {c.seed: value(c) for c in reference}
    return stat([value(c) - ref[c.seed] for c in runs if c.seed in ref])


def binomial_se(p: float, n: int) -> float:
    """Standard error of one Pass@1 estimate on n tasks: the eval noise floor of a single run."""
    return math.sqrt(max(p * (1 - p), 0.0) / max(n, 1))


def mean_curve(xs_per_seed: list[list[float]], ys_per_seed: list[list[float]]):
    """Align seeds by index (same step grid); returns x, mean, min, max over the common length."""
    n = min((len(y) for y in ys_per_seed), default=0)
    if n == 0:
        return [], [], [], []
    x = xs_per_seed[0][:n]
    cols = [[y[i] for y in ys_per_seed if not math.isnan(y[i])] for i in range(n)]
    mean = [statistics.fmean(c) if c else math.nan for c in cols]
    lo = [min(c) if c else math.nan for c in cols]
    hi = [max(c) if c else math.nan for c in cols]
    return x, mean, lo, hi


def smooth(xs: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what exists)."""
    out = []
    for i in range(len(xs)):
        w = [x for x in xs[max(0, i - window + 1): i + 1] if not math.isnan(x)]
        out.append(sum(w) / len(w) if w else math.nan)
    return out


def first_step_started_after(policy_step_min: list[float], switch_step: int) -> int:
    """The first trainer step whose whole batch started at or after `switch_step`: in an
    asynchronous run a batch holds episodes started up to `max_staleness` steps earlier, which the
    environment judged by the old phase; a switch shows in the reward only from this step."""
    for s, v in enumerate(policy_step_min):
        if s >= switch_step and not math.isnan(v) and v >= switch_step:
            return s
    return switch_step


def recovery_steps(reward: list[float], switch_step: int, end_step: int | None = None, pre_window: int = 3,
                   post_window: int = 3, target: float = 0.9,
                   search_from: int | None = None) -> tuple[float, int | None]:
    """Steps after `switch_step` until the reward (mean over `post_window` steps) is back to `target`
    x the pre-switch reward (mean of the `pre_window` steps before the switch), looking only at
    steps before `end_step` (the next switch; default the end of the run) and from `search_from`
    (default the switch; see `first_step_started_after`). Returns (pre-switch reward, steps after
    the switch, or None if it did not recover before `end_step`)."""
    pre = reward[max(0, switch_step - pre_window): switch_step]
    if not pre:
        raise ValueError(f"no steps before the switch at step {switch_step}")
    level = sum(pre) / len(pre)
    end = len(reward) if end_step is None else min(end_step, len(reward))
    post_window = max(1, min(post_window, end - switch_step))  # a phase shorter than the window
    for s in range(max(switch_step, search_from or 0), end - post_window + 1):
        window = reward[s: s + post_window]
        if sum(window) / len(window) >= target * level:
            return level, s - switch_step
    return level, None
