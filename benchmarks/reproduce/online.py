"""Online learning: the style-shift task, the judge switching its preferred style every N trainer
steps. Reward over time for SAO (critic) vs a running-mean baseline, and the recovery time after each
switch: steps until the reward (3-step mean) is back to 90% of its pre-switch level (the 3 steps
before the switch).

`sao bench online` runs it on the toy model (examples/style_shift_cpu.yaml, minutes a run).
`sao bench online --model smollm2` runs it on SmolLM2-135M-Instruct (examples/smollm2_style.yaml: SFT
on all four styles, a critic value-pretrained on the SFT policy's answers, the rule-based judge); its
runs take most of an hour each, so every finished run writes a result file into
results/reproduce/online_smollm2/runs/ at once and `--max-runs N` spreads them over sessions, as the
SmolLM2 main comparison does (run_results.py). SAO's critic is value-pretrained, so neither method
spends steps on a warm-up there: both take the same trainer steps under the same schedule.

`--switch-every N` and `--actor-lr X` change the schedule (the critic's LR follows the actor's at the
paper's 5x, critic_presets.PAPER_LR_RATIO), `--entropy-coef C` adds the entropy bonus to both methods'
policy loss (algorithm.entropy_coef); such a design keeps its results in a folder of its own
(`online_smollm2_every<N>_lr<X>_ent<C>`, `design_suffix`), so the recipe's runs stay valid beside it.
Why: at the recipe's actor LR 1e-5 the SmolLM2 policy narrows onto the first style within a 10-step
phase and no method finds the next one (docs/results.md, section 4); longer phases at a lower LR, or an
entropy term, keep the other styles sampled long enough for a switch to be recoverable at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import SimpleNamespace

import matplotlib.pyplot as plt

from benchmarks.reproduce import run_results
from benchmarks.reproduce.critic_presets import PAPER_LR_RATIO
from benchmarks.reproduce.experiment import Budget, Settings, finish, rl_run, run_and_load
from benchmarks.reproduce.report import band_plot, header, md_table, runs_section, save_fig, write_report
from benchmarks.reproduce.runner import CHECKPOINT_EVERY, Run
from benchmarks.reproduce.starts import Start, smollm2_style_start, style_start
from benchmarks.reproduce.summary import first_step_started_after, recovery_steps, stat

METHODS = ("sao", "running_mean")
FULL_SWITCH, FULL_PHASES = 10, 3
QUICK_SWITCH, QUICK_PHASES = 1, 3
# A switch is measured only from a pre-switch reward of at least this: below it the policy had not learned
# the old style (or had lost every style), the "recovery" target (90% of the level) is met by noise, and a
# recovery count would read as a fast re-adaptation that never happened.
MIN_PRE_LEVEL = 0.1


@dataclass
class RewardCurve:
    """What the recovery analysis reads of a run: the batch reward per trainer step and the oldest
    policy step of each batch's episodes (`rollout/policy_step_min`), NaN where not logged."""

    steps: list[int]
    reward: list[float]
    policy_step_min: list[float]


def curve_of_result(data: dict) -> RewardCurve:
    """From a committed result file (run_results.summarize: missing values stored as null)."""
    def nan(xs):
        return [math.nan if x is None else float(x) for x in xs]
    return RewardCurve(list(data["steps"]), nan(data["reward"]), nan(data["series"].get("rollout/policy_step_min", [])))


def recovery_table(groups: dict[str, list[RewardCurve]], every: int, phases: int) -> tuple[list[list[str]], dict]:
    """Per method and switch: the pre-switch reward and each seed's recovery steps (None: not within the
    phase; "n/a": the pre-switch reward was under MIN_PRE_LEVEL, nothing learned to lose), as table rows
    and as the summary's data."""
    switches = [every * k for k in range(1, phases)]
    rows, data = [], {}
    for m, cs in groups.items():
        per_switch = []
        for i, sw in enumerate(switches):
            end = switches[i + 1] if i + 1 < len(switches) else None
            rec = [recovery_steps(c.reward, sw, end, search_from=first_step_started_after(c.policy_step_min, sw))
                   for c in cs if len(c.reward) > sw]
            pre = stat([r[0] for r in rec])
            steps = [n if level >= MIN_PRE_LEVEL else "n/a" for level, n in rec]
            measured = [x for x in steps if x != "n/a"]
            got = [x for x in measured if x is not None]
            per_switch.append({"switch_step": sw, "pre_reward": pre.values, "recovery_steps": steps})
            rows.append([m, str(sw), pre.fmt(2), ", ".join("never" if x is None else str(x) for x in steps),
                         f"{sum(got) / len(got):.1f}" if got else "never" if measured else "n/a",
                         f"{len(got)}/{len(measured)}" + (f" ({len(steps) - len(measured)} n/a)"
                                                          if len(measured) < len(steps) else "")])
        data[m] = {"reward": [c.reward for c in cs], "switches": per_switch,
                   "mean_reward": stat([sum(c.reward) / len(c.reward) for c in cs if c.reward]).values}
    return rows, data


def schedule(s: Settings) -> tuple[int, int, Budget]:
    """(steps per phase, phases, budget). SmolLM2 starts from a value-pretrained critic and takes no
    warm-up (module docstring); the toy keeps the suite's."""
    every, phases = (QUICK_SWITCH, QUICK_PHASES) if s.quick else (FULL_SWITCH, FULL_PHASES)
    every = s.switch_every or every
    b0 = s.budget
    warmup = 0 if s.model == "smollm2" and not s.quick else b0.warmup
    return every, phases, Budget(batch=b0.batch, steps=every * phases, eval_every=0, eval_size=b0.eval_size,
                                 warmup=warmup)


def _design(s: Settings) -> list[tuple[str, str, str]]:
    """The options of a schedule other than the default one: (command-line flag, folder tag, value)."""
    options = (("--switch-every", "every", s.switch_every), ("--actor-lr", "lr", s.actor_lr),
               ("--entropy-coef", "ent", s.entropy_coef))
    return [(flag, tag, f"{value:g}") for flag, tag, value in options if value]


def design_flags(s: Settings) -> str:
    """The command-line flags of a schedule other than the default one ("" for the default)."""
    return "".join(f" {flag} {value}" for flag, _, value in _design(s))


def design_suffix(s: Settings) -> str:
    """The results folder's suffix for a schedule other than the default one ("" for the default)."""
    return "".join(f"_{tag}{value}" for _, tag, value in _design(s))


def design_overrides(s: Settings) -> tuple[str, ...]:
    """`--actor-lr`: the actor's LR, and the critic's at the paper's ratio to it (the recipes' 5e-5 to 1e-5);
    `--entropy-coef`: the entropy bonus of both methods' policy loss."""
    lrs = (f"actor.optim.lr={s.actor_lr:g}", f"critic.optim.lr={PAPER_LR_RATIO * s.actor_lr:g}") if s.actor_lr else ()
    return (*lrs, *((f"algorithm.entropy_coef={s.entropy_coef:g}",) if s.entropy_coef else ()))


def plan(s: Settings, start: Start, every: int, b: Budget) -> list[Run]:
    """Every run, seed-major: `--max-runs 2` gives both methods a seed first. SmolLM2's runs checkpoint,
    so that one killed with its session resumes (runner.py)."""
    every_ckpt = CHECKPOINT_EVERY if s.model == "smollm2" else 0
    extra = (f"env.kwargs.switch_every={every}", *design_overrides(s))
    return [replace(rl_run(s, start, m, seed, m, extra, budget=b), checkpoint_every=every_ckpt)
            for seed in s.seeds for m in METHODS]


def run(s: Settings) -> int:
    every, phases, b = schedule(s)
    smollm2 = s.model == "smollm2"
    start = smollm2_style_start(s.quick, s.work, s.log) if smollm2 else style_start(s.quick, s.work, s.log)
    runs = plan(s, start, every, b)
    if smollm2:
        groups, results, recorded, note = _recorded(s, start, runs, b)
    else:
        results, curves = run_and_load(s, runs, b.batch, None)
        groups = {m: [RewardCurve(c.steps, c.reward, c.series["rollout/policy_step_min"]) for c in curves.get(m, [])]
                  for m in METHODS}
        recorded, note = None, ""

    rows, data = recovery_table(groups, every, phases)
    fig, ax = plt.subplots(figsize=(10, 4))
    band_plot(ax, {m: ([c.steps for c in cs], [c.reward for c in cs]) for m, cs in groups.items()},
              "trainer step", "train reward (batch mean)", f"style switches every {every} steps")
    switches = [every * k for k in range(1, phases)]
    for sw in switches:
        ax.axvline(sw - 0.5, color="red", linestyle=":", linewidth=1)
    png = save_fig(fig, s.out / "online_style_shift.png")

    model = "SmolLM2-135M-Instruct" if smollm2 and not s.quick else "the toy model"
    md = header(f"Online learning: style shift on {model}, critic (SAO) vs running-mean baseline", s.command,
                s.seeds, s.elapsed_s,
                f"- {phases} phases of {every} trainer steps (batch {b.batch}); the judge's preferred style changes "
                f"at steps {switches}; starting point `{start.dir.name}` ({start.config}); "
                + (f"actor LR {s.actor_lr:g}, critic LR {PAPER_LR_RATIO * s.actor_lr:g} (not the recipe's); "
                   if s.actor_lr else "")
                + (f"entropy bonus {s.entropy_coef:g} in both methods' policy loss; " if s.entropy_coef else "")
                + (f"SAO spends its first {b.warmup} steps on critic warm-up" if b.warmup else
                   "SAO starts from the value-pretrained critic, no warm-up: both methods take the same steps"))
    md += note
    md += md_table(["method", "switch at step", "pre-switch reward (mean ± std, per seed)",
                    "recovery steps per seed", "mean recovery (recovered seeds)", "recovered"], rows)
    md += ("\n\nA switch is 'recovered' when the 3-step mean reward returns to 90% of the mean of the 3 steps before "
           "it; 'never' means not within the run (the next switch or the end). The search starts at the first "
           "step whose whole batch started after the switch (`rollout/policy_step_min`): earlier batches still "
           "hold episodes the judge scored by the old style. 'n/a': the pre-switch reward was under "
           f"{MIN_PRE_LEVEL}, nothing learned to lose, and 90% of it is met by noise; a low level above it still "
           f"makes recovery easy, so read the pre-switch column too.\n\n![reward]({png})\n")
    summary = {"switch_every": every, "phases": phases, "budget": vars(b), "methods": data}
    common = start.rl_overrides(b.eval_size)
    if recorded is None:
        return finish(s, md, results, common, summary)
    md += runs_section(results, run_results.portable_overrides(common, start.dir))
    write_report(s.out, md, {**summary, **recorded})
    return 1 if recorded["failed"] else 0


def _recorded(s: Settings, start: Start, runs, b: Budget):
    """The SmolLM2 runs through per-run result files: train the missing ones (`--max-runs`), then read
    every finished one from its file. Returns the curves by method, the runs as the report lists them
    (the start's directory as a placeholder), the summary's bookkeeping and the report's status line."""
    digest = run_results.sft_and_critic_digest(start)
    rec = run_results.train_missing(s, runs, start.dir, lambda r: digest, lambda r: {"digest": digest},
                                    b.batch, jobs=1 if not s.quick else s.jobs)
    groups = {m: [curve_of_result(rec.done[r]) for r in runs if r.label == m and rec.done[r] is not None]
              for m in METHODS}
    missing = rec.missing
    status = (f"all {len(runs)} runs finished" if not missing else
              f"PARTIAL: {len(runs) - len(missing)} of {len(runs)} runs finished; missing "
              + ", ".join(f"{r.label} seed {r.seed}" for r in missing)
              + f" (`sao bench online --model smollm2{design_flags(s)} --max-runs N` trains N of them)")
    note = f"**{status}.**\n\n"
    if rec.stale:
        note += "Result files set aside (another config, ALGORITHM_VERSION or start): " + ", ".join(rec.stale) + "\n\n"
    listed = [SimpleNamespace(run=run_results.portable(r, start.dir)) for r in runs]
    return groups, listed, rec.summary(), note
