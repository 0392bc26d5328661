"""Throughput: asynchronous vs synchronous SAO on the heavy-tailed workload.

The toy calculator's tool calls wait `latency * X` seconds, X ~ Pareto(1.5) (capped), so a few
trajectories take far longer than the rest: a synchronous batch waits for its slowest member, the
asynchronous trainer takes whichever trajectories finished. Runs go one at a time (never two in
parallel, which would make them compete for the cores), except with --quick, whose numbers mean
nothing anyway. Trajectories/s count trained trajectories per second of training wall time, the
first step (start-up) excluded.
"""

from __future__ import annotations

import dataclasses

import matplotlib.pyplot as plt

from benchmarks.reproduce.experiment import Budget, Settings, finish, rl_run
from benchmarks.reproduce.report import header, md_table, save_fig
from benchmarks.reproduce.runner import execute_all
from benchmarks.reproduce.starts import toy_start
from benchmarks.reproduce.summary import stat

LATENCY = ("env.kwargs={tool_latency_s: 0.05, latency_tail: 1.5}",)


def throughput(result, batch: int) -> dict:
    rows = result.metrics()
    span = rows[-1]["wall_time"] - rows[0]["wall_time"]
    return {"trajectories_per_s": (len(rows) - 1) * batch / span if span > 0 else float("nan"),
            "trainer_idle_fraction": rows[-1]["trainer_idle_fraction"],
            "rollout_idle_fraction": rows[-1]["rollout_idle_fraction"]}


def run(s: Settings) -> int:
    b0 = s.budget
    b = Budget(batch=b0.batch, steps=3 if s.quick else 12, eval_every=0, eval_size=b0.eval_size, warmup=0)
    start = toy_start(s.quick, s.work, s.log)
    runs = [rl_run(s, start, mode, seed, "sao", (f"trainer.mode={mode}", *LATENCY), budget=b)
            for seed in s.seeds for mode in ("sync", "async")]
    jobs = s.jobs if s.quick else 1
    results = execute_all(runs, s.work, jobs=jobs, fresh=s.fresh, log=s.log)
    per = {(r.run.label, r.run.seed): throughput(r, b.batch) for r in results if r.ok}
    rows, data = [], {}
    for mode in ("sync", "async"):
        tp = stat([per[(mode, sd)]["trajectories_per_s"] for sd in s.seeds if (mode, sd) in per])
        ti = stat([per[(mode, sd)]["trainer_idle_fraction"] for sd in s.seeds if (mode, sd) in per])
        ri = stat([per[(mode, sd)]["rollout_idle_fraction"] for sd in s.seeds if (mode, sd) in per])
        rows.append([mode, tp.fmt(2), ti.fmt(2), ri.fmt(2)])
        data[mode] = {"trajectories_per_s": tp.values, "trainer_idle": ti.values, "rollout_idle": ri.values}
    ratios = stat([per[("async", sd)]["trajectories_per_s"] / per[("sync", sd)]["trajectories_per_s"]
                   for sd in s.seeds if ("async", sd) in per and ("sync", sd) in per])
    rows.append(["async / sync", ratios.fmt(2), "", ""])
    data["ratio"] = ratios.values

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for i, mode in enumerate(("sync", "async")):
        vals = data[mode]["trajectories_per_s"]
        ax.bar(i, sum(vals) / max(len(vals), 1), alpha=0.5)
        ax.scatter([i] * len(vals), vals, color="k", s=10, zorder=3)
    ax.set_xticks([0, 1], ["sync", "async"])
    ax.set_ylabel("trajectories trained / s")
    ax.set_title("heavy-tailed tool latency")
    png = save_fig(fig, s.out / "throughput.png")
    md = header("Throughput: asynchronous vs synchronous SAO (heavy-tailed tool latency)", s.command, s.seeds,
                s.elapsed_s, f"- {b.steps} steps x {b.batch} trajectories per run, tool latency 0.05 s x Pareto(1.5); "
                f"starting point `{start.dir.name}`; {'runs one at a time' if jobs == 1 else f'{jobs} runs at a time'}")
    md += md_table(["mode", "trajectories / s: mean ± std (per seed)", "trainer idle fraction",
                    "rollout idle fraction"], rows)
    md += f"\n\n![throughput]({png})\n"
    code = finish(s, md, results, start.rl_overrides(b.eval_size), {"budget": dataclasses.asdict(b), "modes": data})
    return code
