"""Online learning: the style-shift task, the rule-based judge switching its preferred style every
N trainer steps. Reward over time for SAO (critic) vs a running-mean baseline, and the recovery
time after each switch: steps until the reward (3-step mean) is back to 90% of its pre-switch level
(the 3 steps before the switch).
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from benchmarks.reproduce.experiment import Budget, Settings, finish, rl_run, run_and_load
from benchmarks.reproduce.report import band_plot, header, md_table, save_fig
from benchmarks.reproduce.starts import style_start
from benchmarks.reproduce.summary import first_step_started_after, recovery_steps, stat

METHODS = ("sao", "running_mean")
FULL_SWITCH, FULL_PHASES = 10, 3
QUICK_SWITCH, QUICK_PHASES = 1, 3


def run(s: Settings) -> int:
    every, phases = (QUICK_SWITCH, QUICK_PHASES) if s.quick else (FULL_SWITCH, FULL_PHASES)
    b0 = s.budget
    b = Budget(batch=b0.batch, steps=every * phases, eval_every=0, eval_size=b0.eval_size, warmup=b0.warmup)
    start = style_start(s.quick, s.work, s.log)
    extra = (f"env.kwargs.switch_every={every}",)
    runs = [rl_run(s, start, m, seed, m, extra, budget=b) for m in METHODS for seed in s.seeds]
    results, groups = run_and_load(s, runs, b.batch, None)

    switches = [every * k for k in range(1, phases)]
    rows, data = [], {}
    for m in METHODS:
        cs = groups.get(m, [])
        per_switch = []
        for i, sw in enumerate(switches):
            end = switches[i + 1] if i + 1 < len(switches) else None
            rec = [recovery_steps(c.reward, sw, end, search_from=first_step_started_after(
                c.series["rollout/policy_step_min"], sw)) for c in cs if len(c.reward) > sw]
            pre = stat([r[0] for r in rec])
            steps = [r[1] for r in rec]
            got = [x for x in steps if x is not None]
            per_switch.append({"switch_step": sw, "pre_reward": pre.values, "recovery_steps": steps})
            rows.append([m, str(sw), pre.fmt(2), ", ".join("never" if x is None else str(x) for x in steps),
                         f"{sum(got) / len(got):.1f}" if got else "never", f"{len(got)}/{len(steps)}"])
        data[m] = {"reward": [c.reward for c in cs], "switches": per_switch,
                   "mean_reward": stat([sum(c.reward) / len(c.reward) for c in cs if c.reward]).values}

    fig, ax = plt.subplots(figsize=(10, 4))
    band_plot(ax, {m: ([c.steps for c in cs], [c.reward for c in cs]) for m, cs in groups.items()},
              "trainer step", "train reward (batch mean)", f"style switches every {every} steps")
    for sw in switches:
        ax.axvline(sw - 0.5, color="red", linestyle=":", linewidth=1)
    png = save_fig(fig, s.out / "online_style_shift.png")

    md = header("Online learning: style shift, critic (SAO) vs running-mean baseline", s.command, s.seeds,
                s.elapsed_s, f"- {phases} phases of {every} trainer steps (batch {b.batch}); the judge's preferred "
                f"style changes at steps {switches}; starting point `{start.dir.name}` ({start.config}); SAO "
                f"spends its first {b.warmup} steps on critic warm-up")
    md += md_table(["method", "switch at step", "pre-switch reward (mean ± std, per seed)",
                    "recovery steps per seed", "mean recovery (recovered seeds)", "recovered"], rows)
    md += ("\n\nA switch is 'recovered' when the 3-step mean reward returns to 90% of the mean of the 3 steps before "
           "it; 'never' means not within the run (the next switch or the end). The search starts at the first "
           "step whose whole batch started after the switch (`rollout/policy_step_min`): earlier batches still "
           "hold episodes the judge scored by the old style. A low pre-switch level makes "
           f"recovery trivially easy, so read the pre-switch column too.\n\n![reward]({png})\n")
    code = finish(s, md, results, start.rl_overrides(b.eval_size),
                  {"switch_every": every, "phases": phases, "budget": vars(b), "methods": data})
    return code
