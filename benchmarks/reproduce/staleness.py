"""Staleness stress: how each policy loss copes when every trajectory is L policy versions old.

The lag is imposed, not left to the machine's speed: `trainer.mode=sync` with `trainer.policy_lag=L`
makes the rollout engine hold the weights of L actor steps ago, so (after the first L steps) every
trajectory was sampled by the policy of exactly L updates before the one it trains. Compared:
vanilla GRPO (the PPO clip with the ratio against the learner's own log-probs before the update, so
no staleness correction at all: the paper's baseline), GRPO advantages with the DIS mask, and SAO.
Logged over time: the DIS kept fraction (PPO: the unclipped fraction, always 1 for vanilla GRPO,
whose ratio is 1) and the effective sample size of the importance ratios.
"""

from __future__ import annotations

import dataclasses
import math

import matplotlib.pyplot as plt

from benchmarks.reproduce.experiment import Settings, finish, rl_run, run_and_load
from benchmarks.reproduce.report import band_plot, header, md_table, save_fig
from benchmarks.reproduce.starts import toy_start
from benchmarks.reproduce.summary import stat

METHODS = {"grpo": "grpo", "grpo_dis": "grpo_dis", "sao": "sao"}
FULL_LAGS = (1, 4, 16)
QUICK_LAGS = (1,)


def lag_overrides(lag: int) -> tuple[str, ...]:
    return ("trainer.mode=sync", f"trainer.policy_lag={lag}", f"buffer.max_staleness={lag}",
            "buffer.staleness_policy=keep")


def kept(c) -> list[float]:
    """DIS: kept fraction; PPO clip: the fraction of tokens the clip left with a gradient."""
    if any(not math.isnan(x) for x in c.series["actor/kept_fraction"]):
        return c.series["actor/kept_fraction"]
    return [1.0 - x if not math.isnan(x) else math.nan for x in c.series["actor/clip_fraction"]]


def run(s: Settings) -> int:
    b = s.budget
    lags = QUICK_LAGS if s.quick else FULL_LAGS
    start = toy_start(s.quick, s.work, s.log)
    sft = start.evaluate_sft(b.eval_size, s.log)
    runs = [rl_run(s, start, f"{label}@lag{lag}", seed, method, lag_overrides(lag))
            for lag in lags for label, method in METHODS.items() for seed in s.seeds]
    results, groups = run_and_load(s, runs, b.batch, sft["accuracy"])

    rows, data = [], {}
    for label in METHODS:
        base = stat([c.final_eval() for c in groups.get(f"{label}@lag{lags[0]}", [])])
        for lag in lags:
            cs = groups.get(f"{label}@lag{lag}", [])
            final = stat([c.final_eval() for c in cs])
            k = stat([_mean_after(kept(c), lag) for c in cs])
            ess = stat([_mean_after(c.series["actor/ess"], lag) for c in cs])
            rows.append([label, str(lag), str(len(cs)), final.fmt(), f"{final.mean - base.mean:+.3f}",
                         f"{final.mean - sft['accuracy']:+.3f}", k.fmt(3), ess.fmt(3)])
            data[f"{label}@lag{lag}"] = {"final_eval": final.values, "kept": [kept(c) for c in cs],
                                         "ess": [c.series["actor/ess"] for c in cs], "reward": [c.reward for c in cs],
                                         "eval_points": [c.eval_points for c in cs]}

    fig, axes = plt.subplots(len(lags), 3, figsize=(15, 3.6 * len(lags)), squeeze=False)
    for i, lag in enumerate(lags):
        sel = {label: groups.get(f"{label}@lag{lag}", []) for label in METHODS}
        band_plot(axes[i][0], {k: ([c.steps for c in cs], [c.reward for c in cs]) for k, cs in sel.items()},
                  "trainer step", "train reward", f"lag {lag}: training reward")
        band_plot(axes[i][1], {k: ([c.steps for c in cs], [kept(c) for c in cs]) for k, cs in sel.items()},
                  "trainer step", "kept (DIS) / unclipped (PPO) fraction", f"lag {lag}: tokens with a gradient")
        band_plot(axes[i][2],
                  {k: ([c.steps for c in cs], [c.series["actor/ess"] for c in cs]) for k, cs in sel.items()},
                  "trainer step", "ESS of the IS ratios", f"lag {lag}: effective sample size")
    png = save_fig(fig, s.out / "staleness_curves.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for label in METHODS:
        means = [stat([c.final_eval() for c in groups.get(f"{label}@lag{lag}", [])]) for lag in lags]
        ax.errorbar(list(lags), [m.mean for m in means], yerr=[m.std for m in means], marker="o", capsize=3,
                    label=label)
    ax.axhline(sft["accuracy"], color="gray", linestyle="--", linewidth=1, label="SFT start")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("policy lag (versions)")
    ax.set_ylabel("final eval accuracy (mean ± std)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    png2 = save_fig(fig, s.out / "staleness_final_eval.png")

    md = header("Staleness stress: vanilla GRPO vs GRPO+DIS vs SAO under an imposed policy lag",
                s.command, s.seeds, s.elapsed_s,
                f"- budget: {b.trajectories} trajectories per run ({b.steps} steps x {b.batch}), synchronous "
                f"batches with `trainer.policy_lag=L` (every trajectory exactly L versions old once L steps "
                f"have passed); lags {list(lags)}; SFT start accuracy {sft['accuracy']:.3f} on {b.eval_size} tasks")
    md += md_table(["method", "lag", "seeds", "final eval: mean ± std (per seed)", f"Δ vs lag {lags[0]}",
                    "Δ vs SFT", "kept / unclipped fraction (after lag)", "ESS (after lag)"], rows)
    md += (f"\n\nKept fraction and ESS are averaged over the steps after the lag took full effect (step >= L). "
           f"With L close to the run length the engine holds the starting policy for most of the run, so the "
           f"largest lag is close to learning off-policy from the SFT model's samples.\n\n"
           f"![curves]({png})\n\n![final eval vs lag]({png2})\n")
    code = finish(s, md, results, start.rl_overrides(b.eval_size),
                  {"sft": sft, "budget": dataclasses.asdict(b), "lags": list(lags), "runs_data": data})
    return code


def _mean_after(xs: list[float], lag: int) -> float:
    vals = [x for x in xs[lag:] if not math.isnan(x)] or [x for x in xs if not math.isnan(x)]
    return sum(vals) / len(vals) if vals else math.nan
