"""Main comparison on the toy multi-turn tool task: SFT start, GRPO (n=4), GRPO+DIS, SAO.

`grpo_rollout_ratio` (the PPO ratio against the rollout log-probs) is a control row: it is what the
suite called `grpo` before vanilla GRPO replaced it, so comparing it with the earlier results
separates that renaming from the other changes made since.

Equal trajectory budget, every method asynchronous with the same staleness bound, eval accuracy
(Pass@1, temperature 1.0, the same held-out tasks for every run) against trajectories consumed and
against wall time.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt

from benchmarks.reproduce.experiment import Settings, finish, rl_run, run_and_load
from benchmarks.reproduce.report import band_plot, header, md_table, save_fig
from benchmarks.reproduce.starts import toy_start
from benchmarks.reproduce.summary import binomial_se, paired_delta, stat

METHOD_LABELS = ("grpo", "grpo_rollout_ratio", "grpo_dis", "sao")


def eval_table(groups, budget) -> tuple[list[list[str]], dict]:
    rows, data = [], {}
    for label, cs in groups.items():
        final = stat([c.final_eval() for c in cs])
        reward = stat([c.last_fraction_mean("reward") for c in cs])
        wall = stat([c.run_wall_s for c in cs])
        delta = paired_delta(cs, groups.get("sao", []))
        rows.append([label, str(len(cs)), final.fmt(), delta.fmt(), reward.fmt(), f"{wall.mean:.0f}"])
        data[label] = {"final_eval": final.values, "paired_delta_vs_sao": delta.values,
                       "reward_last_quarter": reward.values, "wall_s": wall.values,
                       "eval_points": [c.eval_points for c in cs], "reward": [c.reward for c in cs]}
    return rows, data


def run(s: Settings) -> int:
    b = s.budget
    start = toy_start(s.quick, s.work, s.log)
    sft = start.evaluate_sft(b.eval_size, s.log)
    runs = [rl_run(s, start, m, seed, m) for m in METHOD_LABELS for seed in s.seeds]
    results, groups = run_and_load(s, runs, b.batch, sft["accuracy"])

    rows, data = eval_table(groups, b)
    rows.insert(0, ["sft (start)", "1", f"{sft['accuracy']:.3f}", "-", "-", "-"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    band_plot(axes[0], {k: ([[p[0] for p in c.eval_points] for c in cs], [[p[2] for p in c.eval_points] for c in cs])
                        for k, cs in groups.items()}, "trajectories consumed", "eval accuracy (Pass@1)",
              "eval vs trajectories", sft["accuracy"], "SFT start")
    band_plot(axes[1], {k: ([[p[1] for p in c.eval_points] for c in cs], [[p[2] for p in c.eval_points] for c in cs])
                        for k, cs in groups.items()}, "wall time of the run (s)", "eval accuracy (Pass@1)",
              "eval vs wall time", sft["accuracy"], "SFT start")
    band_plot(axes[2], {k: ([c.trajectories for c in cs], [c.reward for c in cs]) for k, cs in groups.items()},
              "trajectories consumed", "train reward (batch mean)", "training reward")
    png = save_fig(fig, s.out / "main_comparison.png")
    se = binomial_se(sft["accuracy"], b.eval_size)
    md = header("Main comparison: SFT vs GRPO vs GRPO+DIS vs SAO (toy multi-turn calculator)", s.command, s.seeds,
                s.elapsed_s,
                f"- budget: {b.trajectories} trajectories per run ({b.steps} steps x {b.batch}); SAO spends "
                f"{b.warmup} of the steps on critic warm-up; eval on {b.eval_size} held-out tasks every "
                f"{b.eval_every} steps; starting point `{start.dir.name}` ({start.config})")
    md += md_table(["method", "seeds", "final eval accuracy: mean ± std (per seed)", "Δ vs sao, paired by seed",
                    "train reward, last quarter", "run wall s"], rows)
    md += (f"\n\nEval noise floor: one evaluation on {b.eval_size} tasks has a binomial standard error of "
           f"{se:.3f} at the SFT accuracy ({binomial_se(0.5, b.eval_size):.3f} at 50%); differences between "
           f"methods smaller than about twice that, or than the seed spread, are not resolved by this "
           f"experiment.\n\n![curves]({png})\n")
    code = finish(s, md, results, start.rl_overrides(b.eval_size), {"sft": sft, "budget": vars(b), "methods": data})
    return code or int(any(math.isnan(c.final_eval()) for cs in groups.values() for c in cs))
