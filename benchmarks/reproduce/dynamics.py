"""Training dynamics over long asynchronous runs (`sao bench dynamics`): does vanilla GRPO degrade with
lag, does DIS hold it, does SAO separate late?

The paper's dynamics claims are about hundreds of steps of asynchronous training: vanilla GRPO
collapses near step 160, GRPO+DIS stays stable, SAO and GRPO+DIS track each other early and separate
after about 400 steps. The other toy experiments stop at 20 steps. Here every method trains
`PAPER.full.steps` actor steps of `PAPER.full.batch` trajectories on the toy multi-turn calculator from the shared
starting point (SFT policy, value-pretrained critic), asynchronously with the lag the paper's setting
implies: the engine holds the weights of `policy_lag` steps ago (`trainer.policy_lag`) and rollouts
may run `staleness` steps ahead of the trainer (`buffer.max_staleness`), so a trajectory is 4-8
versions old when it is trained on, older when its episode spans weight updates; tool calls wait a
heavy-tailed latency, so long episodes arrive late and staler. Budget A, the paper's convention:
every method the same actor steps x trajectories per step; SAO's critic warm-up steps come on top
(they train the critic only).

Each finished run writes a result file to OUT/runs/ at once (run_results.py) and is skipped by the
next invocation; `--max-runs N` trains N of the missing ones, so the twelve runs (three seeds of four
methods) can be spread over sessions and committed one by one. The starting point is pinned in
OUT/start/ (starts.pin_start) with the first run, so a later session's runs start from the same weights
rather than from an SFT retrained on another CPU. The report is rebuilt from the result
files: held-out accuracy against actor steps and wall time, training reward, the DIS kept fraction
(PPO: the unclipped fraction) and the lag histogram, per method and seed.

`--stress` (results in OUT/../dynamics_stress/): the same from the same start with twice the lag and 4x
the actor LR, 100 actor steps: the regime where the importance ratios leave the DIS band, which the
paper's claims about vanilla GRPO's collapse and DIS's stability are about (STRESS below).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import matplotlib.pyplot as plt

from benchmarks.reproduce import run_results
from benchmarks.reproduce.experiment import METHODS, Budget, Settings
from benchmarks.reproduce.report import header, md_table, runs_section, save_fig, write_report
from benchmarks.reproduce.runner import Run, RunResult
from benchmarks.reproduce.starts import Start, pin_start, toy_start
from benchmarks.reproduce.summary import stat

LATENCY = "env.kwargs={tool_latency_s: 0.02, latency_tail: 1.5}"
ROWS = ("sao", "grpo", "grpo_dis", "running_mean")
# Rows beyond the methods (the stress regime's): label -> (method, its overrides on top of the method's).
VARIANTS = {
    # The stress regime raises the actor's LR 4x (5e-5 -> 2e-4) and leaves the critic's at the config's
    # 3e-4: this row raises the critic's 4x too (1.2e-3), so a critic that lags a fast-moving policy and
    # the single-sample advantage's variance can be told apart (docs/results.md, section 8).
    "sao_critic_lr4x": ("sao", ("critic.optim.lr=0.0012",)),
    # The other way to let the critic keep pace: twice the critic steps per actor step at the config's LR.
    "sao_critic_k4": ("sao", ("algorithm.critic_steps=4",)),
}
FIGURE = "dynamics.png"


@dataclass(frozen=True)
class Regime:
    """How stale the rollouts are and how fast the policy moves between versions."""

    policy_lag: int  # trainer.policy_lag: the engine holds the weights of this many steps ago
    staleness: int  # buffer.max_staleness: how far rollouts may run ahead of the trainer
    actor_lr: float | None  # None: the config's (5e-5)
    full: Budget
    quick: Budget
    rows: tuple[str, ...] = ROWS  # ROWS and VARIANTS labels


# The paper's setting at toy scale: at the config's LR the ratios stay in the DIS band (0.1% masked).
PAPER = Regime(4, 4, None, Budget(batch=16, steps=500, eval_every=25, eval_size=200, warmup=10),
               Budget(batch=8, steps=3, eval_every=3, eval_size=8, warmup=1))
# `--stress`: twice the lag and 4x the LR, where the ratios leave the band (DIS masks 2-7% of tokens) and
# a one-seed probe of vanilla GRPO fell from the SFT start's 0.6 to 0.02 within 60 steps while GRPO+DIS
# held; at 10x the LR (5e-4) GRPO+DIS fell to 0.02 as well.
STRESS = Regime(8, 8, 2e-4, Budget(batch=16, steps=100, eval_every=10, eval_size=200, warmup=10),
                Budget(batch=8, steps=3, eval_every=3, eval_size=8, warmup=1), rows=(*ROWS, *VARIANTS))


def method_of(label: str) -> str:
    return VARIANTS[label][0] if label in VARIANTS else label


def warmup_of(label: str, b: Budget) -> int:
    """The critic-only warm-up steps of a row: SAO's, and none for the critic-free baselines."""
    return b.warmup if method_of(label) == "sao" else 0


def regime(s: Settings) -> Regime:
    return STRESS if s.stress else PAPER


def async_overrides(b: Budget, r: Regime) -> tuple[str, ...]:
    return ("trainer.mode=async", f"trainer.policy_lag={r.policy_lag}", f"buffer.max_staleness={r.staleness}",
            "buffer.staleness_policy=keep", f"rollout.concurrency={2 * b.batch}", LATENCY,
            *(() if r.actor_lr is None else (f"actor.optim.lr={r.actor_lr:g}",)))


def plan(start: Start, b: Budget, seeds: list[int], r: Regime = PAPER) -> list[Run]:
    """Every run, seed-major, so that `--max-runs 4` gives every method one seed first."""
    runs = []
    for seed in seeds:
        for label in r.rows:
            extra = VARIANTS[label][1] if label in VARIANTS else ()
            runs.append(Run(label, seed, start.config, (
                *start.rl_overrides(b.eval_size), *METHODS[method_of(label)], *extra, *async_overrides(b, r),
                f"algorithm.critic_warmup_steps={warmup_of(label, b)}", f"run.total_steps={b.steps}",
                f"buffer.batch_size={b.batch}", f"parallel.micro_batch_size={b.batch}",
                f"run.eval_every={b.eval_every}")))
    return runs


def run(s: Settings) -> int:
    r = regime(s)
    b = r.quick if s.quick else r.full
    # Both regimes start from the one pinned start, the paper regime's (results/reproduce/dynamics/start).
    pin = s.out.parent / "dynamics" / "start"
    start = toy_start(s.quick, s.work, s.log, pin=pin)
    sft = start.evaluate_sft(b.eval_size, s.log)
    pin_start(start, pin)  # later sessions' runs start from these very weights
    digest = run_results.sft_and_critic_digest(start)
    runs = plan(start, b, s.seeds, r)
    # One run at a time: the runs' wall times and lags are only comparable when they do not share cores.
    rec = run_results.train_missing(s, runs, start.dir, lambda run: digest,
                                    lambda run: {"digest": digest, "accuracy": sft["accuracy"], "n": sft["n"]},
                                    b.batch, jobs=1 if not s.quick else s.jobs)
    report(s, b, r, start, sft, runs, rec.done, rec.failed, rec.stale)
    return 1 if rec.failed else 0


def actor_steps(data: dict, warmup: int) -> list[int]:
    """The actor step of every trainer step of a run (critic warm-up steps are negative)."""
    return [step - warmup for step in data["steps"]]


def kept(data: dict) -> list[float | None]:
    """DIS: the kept fraction; the PPO clip: the fraction of tokens the clip left with a gradient."""
    dis = data["series"].get("actor/kept_fraction", [])
    if any(x is not None for x in dis):
        return dis
    return [None if x is None else 1.0 - x for x in data["series"].get("actor/clip_fraction", [])]


def window_mean(xs: list[float | None], lo: int, hi: int, steps: list[int]) -> float:
    vals = [x for x, st in zip(xs, steps) if lo <= st < hi and x is not None]
    return sum(vals) / len(vals) if vals else math.nan


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def plot(runs: list[Run], done: dict, b: Budget, sft_acc: float, out: Path, title: str) -> str:
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    colors = dict(zip((*ROWS, *VARIANTS), plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    styles = ["-", "--", ":", "-."]
    for r in runs:
        data = done[r]
        if data is None:
            continue
        warm = warmup_of(r.label, b)
        kw = dict(color=colors[r.label], linestyle=styles[(r.seed - 1) % len(styles)], linewidth=1,
                  label=f"{r.label} s{r.seed}")
        pts = [(0, 0.0, sft_acc), *[(n // b.batch - warm, t, acc) for n, t, acc in data["eval_points"]]]
        axes[0][0].plot([p[0] for p in pts], [p[2] for p in pts], marker=".", **kw)
        axes[0][1].plot([p[1] / 60 for p in pts], [p[2] for p in pts], marker=".", **kw)
        steps = actor_steps(data, warm)
        axes[1][0].plot(steps, _smooth(data["reward"]), **kw)
        axes[1][1].plot(steps, _smooth(kept(data)), **kw)
    labels = (("actor step", "held-out accuracy (T=1)"), ("wall time of the run (min)", "held-out accuracy (T=1)"),
              ("actor step", "train reward (mean of 10 steps)"),
              ("actor step", "DIS kept / PPO unclipped fraction (mean of 10)"))
    for ax, (xl, yl) in zip([a for row in axes for a in row], labels):
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    for ax in axes[0]:
        ax.axhline(sft_acc, color="gray", linewidth=1, linestyle=":")
    axes[0][0].legend(fontsize=6, ncol=2)
    fig.suptitle(title)
    return save_fig(fig, out / FIGURE)


def _smooth(xs: list[float | None], k: int = 10) -> list[float]:
    out = []
    for i in range(len(xs)):
        vals = [x for x in xs[max(0, i - k + 1): i + 1] if x is not None]
        out.append(sum(vals) / len(vals) if vals else math.nan)
    return out


def report(s: Settings, b: Budget, rg: Regime, start: Start, sft: dict, runs: list[Run], done: dict,
           failed: list[RunResult], stale: list[str]) -> None:
    missing = [r for r in runs if done[r] is None]
    status = f"all {len(runs)} runs finished" if not missing else \
        f"PARTIAL: {len(runs) - len(missing)} of {len(runs)} runs finished"
    title = ("Training dynamics over long asynchronous runs (toy calculator)"
             + (f", stress: lag {rg.policy_lag}, actor LR {rg.actor_lr:g}" if rg is STRESS else "")
             if not s.quick else "Dynamics harness (--quick: the numbers mean nothing)")
    png = plot(runs, done, b, sft["accuracy"], s.out, f"{title}\n({status})")
    third = max(1, b.steps // 3)
    lr = "the config's" if rg.actor_lr is None else f"{rg.actor_lr:g}"
    windows = [(0, third), (third, 2 * third), (2 * third, b.steps)]
    md = header(title, s.command, s.seeds, s.elapsed_s,
                f"- budget A: {b.steps} actor steps x {b.batch} trajectories for every method (GRPO: "
                f"{b.batch // 4} prompts x 4); SAO adds {b.warmup} critic-only warm-up steps\n"
                f"- asynchrony: trainer.policy_lag={rg.policy_lag}, buffer.max_staleness={rg.staleness}, heavy-tailed "
                f"tool latency (`{LATENCY}`): trajectories are {rg.policy_lag}-{rg.policy_lag + rg.staleness} versions "
                f"old by the admission rule, older when an episode spans weight updates (the lag histogram)\n"
                f"- actor LR: {lr}\n"
                + "".join(f"- {label}: {method_of(label)} with `{' '.join(VARIANTS[label][1])}`\n"
                          for label in rg.rows if label in VARIANTS) +
                f"- held-out accuracy on {b.eval_size} tasks at T=1 every {b.eval_every} steps; starting point "
                f"`{start.dir.name}` (SFT + value-pretrained critic)")
    md += f"**{status}.**"
    if missing:
        md += " Missing: " + ", ".join(f"{r.label} seed {r.seed}" for r in missing) + \
            f". `sao bench dynamics{' --stress' if rg is STRESS else ''} --max-runs N` trains N of them."
    md += "\n\n"
    rows = []
    per: dict[str, list[dict]] = {}
    for r in runs:
        data = done[r]
        if data is None:
            continue
        per.setdefault(r.label, []).append(data)
        warm = warmup_of(r.label, b)
        steps = actor_steps(data, warm)
        accs = [acc for _, _, acc in data["eval_points"]]
        rows.append([r.label, str(r.seed), _f(accs[-1] if accs else None), _f(max(accs) if accs else None),
                     *[_f(window_mean(data["reward"], lo, hi, steps)) for lo, hi in windows],
                     *[_f(window_mean(kept(data), lo, hi, steps)) for lo, hi in windows],
                     _f(window_mean(data["series"].get("critic/explained_variance", []), 2 * third, b.steps, steps)),
                     " ".join(f"{k}:{v}" for k, v in data["lag_histogram"].items()),
                     f"{data['wall_s'] / 60:.0f}", _f(data.get("load_avg"), 1)])
    ws = [f"{lo}-{hi - 1}" for lo, hi in windows]
    md += md_table(["method", "seed", "final held-out", "best held-out", *[f"reward, steps {w}" for w in ws],
                    *[f"kept, steps {w}" for w in ws], "critic EV, last third", "lag histogram", "wall (min)",
                    "load"], rows)
    summary = [[label, str(len(ds)), stat([d["eval_points"][-1][2] for d in ds]).fmt(),
                stat([window_mean(d["reward"], 2 * third, b.steps,
                                  actor_steps(d, warmup_of(label, b))) for d in ds]).fmt()]
               for label, ds in per.items()]
    if summary:
        md += "\n\nPer method (mean ± std over seeds, per-seed values in brackets):\n\n"
        md += md_table(["method", "seeds", "final held-out", f"train reward, steps {ws[-1]}"], summary)
    md += (f"\n\nOne evaluation on {b.eval_size} tasks has a binomial standard error of up to "
           f"{0.5 / math.sqrt(b.eval_size):.3f}.\n\n![dynamics]({png})\n")
    if stale:
        md += "\nResult files set aside (another config or starting point): " + ", ".join(stale) + "\n"
    md += runs_section([SimpleNamespace(run=run_results.portable(r, start.dir)) for r in runs],
                       run_results.portable_overrides(start.rl_overrides(b.eval_size), start.dir))
    write_report(s.out, md, {**run_results.bookkeeping(runs, done, failed, stale), "budget": vars(b),
                             "regime": {"policy_lag": rg.policy_lag, "staleness": rg.staleness,
                                        "actor_lr": rg.actor_lr}, "sft": sft})
    s.log(f"report: {len(runs) - len(missing)} of {len(runs)} runs; {s.out / 'results.md'}")
