"""The SmolLM2-135M-Instruct learning curve (README): SFT once, then SAO with two seeds, then the plot.

    make smollm2-curve          # = .venv/bin/python benchmarks/smollm2_curve.py
    .venv/bin/python benchmarks/smollm2_curve.py [--seeds 1 2] [--config examples/smollm2_arith.yaml]
                                                 [--work runs/smollm2/curve] [--out results/smollm2]
                                                 [--plot-only] [-- k=v ...]    # overrides for every stage

What runs, each as its own `sao` subprocess exactly as a user types it (the real CLI):
  0. `sao eval CONFIG --checkpoint <model.path>`        -> the instruct model's held-out accuracy (no SFT)
  1. `sao sft CONFIG run.dir=WORK/seed1 run.seed=S1 sft.eval=false`   -> WORK/seed1/sft_model
  2. `sao value-pretrain CONFIG run.dir=WORK/seed1 run.seed=S1`       -> WORK/seed1/critic_pretrained
     (the critic fitted on the SFT policy's rollouts; the recipe's value_pretrain.cache_dir keeps it per
     SFT model and settings, so a second invocation or checkout with the same SFT weights reuses it)
  3. `sao train CONFIG run.dir=WORK/seed1 run.seed=S1 --resume` (starts from that sft_model and critic:
     stage wiring)
  4. `sao train CONFIG run.dir=WORK/seedN run.seed=N actor.init=WORK/seed1/sft_model
     critic.init=WORK/seed1/critic_pretrained --resume` for the other seeds
`--paper-critic` adds the paper's critic settings to every train stage (benchmarks/reproduce/critic_presets.py:
10 critic-only warm-up steps, K=2, critic LR 5x the actor's); `--no-value-pretrain` skips stage 2 (the
critic then starts from the SFT weights, as the first curve did).
`--resume` makes a second invocation continue a killed training run from its latest checkpoint (the
recipe saves every 5 steps); a run dir without a checkpoint is started over by it.
Every evaluation uses the same held-out tasks (arith_python's eval split), so seeds vary only RL. The
trainer's first evaluation comes after the critic warm-up (run.eval_every = critic_warmup_steps), before
the actor's first update: that is the curve's step 0, the SFT model on the live engine.
A stage whose final artefact exists is not run again (delete WORK to start over).

Measured per stage: wall seconds, the peak memory of the whole process tree (trainer + vLLM engine
core + sandboxes, sampled every second, proportional set size where the kernel reports it, so shared
pages count once; a sandbox launch caught between fork and exec is not counted twice), the peak rise of
the machine's memory in use over the stage (total - available: a cross-check that does not depend on
walking the tree, but counts anything else the machine runs), CPU seconds per part of the tree (the
trainer process, which also runs the agent loop; vLLM's engine core and worker; everything else:
sandboxes), and the 1-minute load average
sampled every second (RUN_DIR/STAGE_load.jsonl; each training step's timing is reported with the mean
load during that step: other users of the machine inflate timings). Written to OUT: curve.png,
summary.json, results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SAO = str(Path(sys.executable).with_name("sao"))
DONE = {"sft": "sft_model/config.json", "value-pretrain": "critic_pretrained/config.json",
        "train": "final_model/config.json", "eval": "base_eval.jsonl"}
TIME_KEYS = ("time/wait_batch_s", "time/critic_forward_s", "time/critic_train_s", "time/actor_train_s",
             "time/weight_sync_s", "time/eval_s", "step_time_s")


def _part(proc, root: int) -> str:
    """Which part of the recipe's process tree a process is (for CPU seconds per part)."""
    if proc.pid == root:
        return "trainer"
    try:
        text = (proc.name() + " " + " ".join(proc.cmdline()[:3])).lower()
    except Exception:
        return "other"
    return "vllm" if ("vllm" in text or "enginecore" in text or "worker" in text) else "other"


def _peek(pid: int) -> tuple[tuple, int] | None:
    import psutil

    try:
        p = psutil.Process(pid)
        return tuple(p.cmdline()), p.memory_info().rss
    except psutil.Error:
        return None


def sample_tree(root: int, cpu: dict[int, tuple[str, float]]) -> int:
    """Bytes held by a process and all its descendants (PSS if available, else RSS); updates each
    process's CPU seconds (user + system) in `cpu` (pid -> (part, seconds))."""
    import psutil

    try:
        procs = [psutil.Process(root)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return 0
    total, seen = 0, {}
    now = time.time()
    for p in procs:
        try:
            mi = p.memory_full_info() if hasattr(p, "memory_full_info") else p.memory_info()
            cmd = tuple(p.cmdline())
            seen[p.pid] = (cmd, mi.rss)
            parent = seen.get(p.ppid()) or _peek(p.ppid())
            # A sandbox launch between fork/vfork and exec is a clone of the trainer: with vfork it
            # reports the trainer's whole address space as its own. Counting it doubled the peak
            # (seed 1 of the curve: 22.5 GiB for ~16 GiB in use), so a child that still runs its
            # parent's command line, or that is young and as large as its parent, is its parent.
            if parent and (cmd == parent[0] or (now - p.create_time() < 5.0
                                                and abs(mi.rss - parent[1]) < 0.02 * parent[1])):
                continue
            total += getattr(mi, "pss", None) or mi.rss
            t = p.cpu_times()
            # re-read while "other": vLLM's processes start as plain `python -c` and rename themselves
            part = cpu[p.pid][0] if cpu.get(p.pid, ("other",))[0] != "other" else _part(p, root)
            cpu[p.pid] = (part, t.user + t.system)
        except psutil.Error:
            continue
    return total


def run_stage(stage: str, config: str, overrides: list[str], run_dir: Path, log: Path) -> dict:
    """One `sao STAGE` subprocess; returns wall seconds, peak tree memory, CPU seconds per part, load."""
    if (run_dir / DONE[stage]).exists():
        prev = run_dir / f"{stage}_stage.json"
        return {**(json.loads(prev.read_text()) if prev.exists() else {}), "cached": True}
    cmd = [SAO, stage, config, *overrides]  # `sao eval` takes --checkpoint/--out among them
    print(f"smollm2_curve: {' '.join(cmd)}  (log: {log})", flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
           "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    load0, t0 = os.getloadavg()[0], time.monotonic()
    log.parent.mkdir(parents=True, exist_ok=True)
    load_log = run_dir / f"{stage}_load.jsonl"
    with open(log, "a") as f, open(load_log, "a") as lf:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        import psutil

        def used() -> int:  # the machine's memory in use (page cache excluded): a cross-check of the tree sum
            vm = psutil.virtual_memory()
            return vm.total - vm.available
        peak, loads, cpu, used0, peak_used = [0], [], {}, used(), [0]

        def sample() -> None:
            while proc.poll() is None:
                peak[0] = max(peak[0], sample_tree(proc.pid, cpu))
                peak_used[0] = max(peak_used[0], used() - used0)
                loads.append(os.getloadavg()[0])
                lf.write(json.dumps({"t": time.time(), "load1": loads[-1]}) + "\n")
                lf.flush()
                time.sleep(1.0)
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        rc = proc.wait()
        th.join()
    cpu_s: dict[str, float] = {}
    for part, secs in cpu.values():
        cpu_s[part] = round(cpu_s.get(part, 0.0) + secs, 1)
    res = {"stage": stage, "cmd": " ".join(cmd), "rc": rc, "wall_s": round(time.monotonic() - t0, 1),
           "peak_mem_gib": round(peak[0] / 2 ** 30, 2),
           "peak_machine_used_gib": round(peak_used[0] / 2 ** 30, 2), "cpu_s": cpu_s, "load1_start": load0,
           "load1_end": os.getloadavg()[0], "load1_mean": round(statistics.mean(loads), 2) if loads else load0}
    if rc != 0:
        raise SystemExit(f"smollm2_curve: `{' '.join(cmd)}` failed with exit code {rc}; see {log}")
    (run_dir / f"{stage}_stage.json").write_text(json.dumps(res))
    return res


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def step_loads(metrics: list[dict], load_log: Path) -> None:
    """Adds `load1` to each step's metrics: the mean 1-minute load average sampled while it ran."""
    samples = read_jsonl(load_log)
    for m in metrics:
        end = m.get("wall_time")
        if end is None:
            continue
        start = end - m.get("step_time_s", 0.0) - m.get("time/wait_batch_s", 0.0) - m.get("time/eval_s", 0.0)
        during = [x["load1"] for x in samples if start - 1.0 <= x["t"] <= end + 1.0]
        if during:
            m["load1"] = round(statistics.mean(during), 2)


def curve_of(run_dir: Path) -> dict:
    """Held-out accuracy by actor step and the per-step training metrics of one `sao train` run."""
    import yaml

    warmup = yaml.safe_load((run_dir / "config.yaml").read_text())["algorithm"]["critic_warmup_steps"]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    step_loads(metrics, run_dir / "train_load.jsonl")
    # Logged after trainer step m["step"]: actor updates done by then = step + 1 - warm-up.
    points = [(m["step"] + 1 - warmup, m["eval/accuracy"]) for m in metrics if "eval/accuracy" in m]
    n_eval = len(read_jsonl(next(iter(sorted((run_dir / "eval").glob("step_*.jsonl"))))))
    return {"eval": points, "n_eval": n_eval, "metrics": metrics, "warmup": warmup}


def timing_split(metrics: list[dict]) -> dict:
    """Median seconds of each phase over the actor steps (after the warm-up), and the median load
    average they ran under; eval seconds over the steps that evaluated."""
    actor = [m for m in metrics if "time/actor_train_s" in m]
    out = {}
    for k in TIME_KEYS:
        vals = [m[k] for m in (metrics if k == "time/eval_s" else actor) if k in m]
        if vals:
            out[k] = round(statistics.median(vals), 2)
    loads = [m["load1"] for m in actor if "load1" in m]
    if loads:
        out["load1"] = round(statistics.median(loads), 2)
    return out


def plot(curves: dict[int, dict], base_acc: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for seed, c in sorted(curves.items()):
        xs, ys = zip(*c["eval"])
        a.plot(xs, ys, marker="o", label=f"seed {seed}")
        tr = [(m["step"] + 1 - c["warmup"], m["reward"]) for m in c["metrics"]]
        b.plot([x for x, _ in tr], [y for _, y in tr], alpha=0.8, label=f"seed {seed}")
    a.axhline(base_acc, color="gray", linestyle=":", label="instruct model, no SFT")
    a.set(title=f"held-out accuracy (n={next(iter(curves.values()))['n_eval']}, T=1)",
          xlabel="actor step (0 = SFT model)", ylabel="accuracy")
    b.set(title="training batch reward", xlabel="actor step (<= 0: critic warm-up)", ylabel="mean reward")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("SmolLM2-135M-Instruct, arith_python + Python tool, SAO on 2 CPU cores")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def report(curves: dict[int, dict], base_acc: float, stages: dict, out: Path, command: str) -> dict:
    summary = {"command": command, "base_accuracy": base_acc, "stages": stages, "seeds": {}}
    steps = sorted({x for c in curves.values() for x, _ in c["eval"]})
    lines = ["# SmolLM2-135M-Instruct learning curve", "", f"Command: `{command}`", "",
             f"Instruct model without SFT, held-out accuracy: {base_acc:.3f}", "",
             "| seed | " + " | ".join(f"step {x}" + (" (SFT)" if x == 0 else "") for x in steps)
             + " | gain |", "| --- | " + " | ".join("---" for _ in steps) + " | --- |"]
    for seed, c in sorted(curves.items()):
        ys = [y for _, y in c["eval"]]
        by_step = dict(c["eval"])  # a run that ended early has no value at the later steps
        summary["seeds"][seed] = {"eval": c["eval"], "gain": ys[-1] - ys[0],
                                  "timing_median_s": timing_split(c["metrics"]),
                                  "logprob_mismatch_lag0_median": statistics.median(
                                      [m["logprob_mismatch_lag0"] for m in c["metrics"] if "logprob_mismatch_lag0" in m]
                                      or [float("nan")])}
        lines.append(f"| {seed} | " + " | ".join(f"{by_step[x]:.3f}" if x in by_step else "-" for x in steps)
                     + f" | {ys[-1] - ys[0]:+.3f} |")
    lines += ["", "Stages (wall seconds; peak memory of the process tree; peak rise of the machine's memory in use; "
              "1-minute load average during the stage):", ""]
    for name, s in stages.items():
        lines.append(f"- {name}: {s.get('wall_s')} s, {s.get('peak_mem_gib')} GiB, "
                     f"machine +{s.get('peak_machine_used_gib')} GiB, "
                     f"load {s.get('load1_mean')}"
                     + (" (cached from an earlier invocation)" if s.get("cached") else ""))
    for seed in curves:  # what a user of the recipe runs: sft, value-pretrain, train (not the base eval)
        parts = {name: stages.get(label, {}) for name, label in
                 (("sft", "sft"), ("value-pretrain", "value-pretrain"), ("train", f"train seed {seed}"))}
        parts = {name: st for name, st in parts.items() if st.get("wall_s")}
        if "sft" in parts and "train" in parts:
            lines.append(f"- the recipe for seed {seed} ({' + '.join(parts)}): "
                         f"{sum(st['wall_s'] for st in parts.values()) / 60:.1f} min, "
                         f"peak {max(st['peak_mem_gib'] for st in parts.values())} GiB")
    lines += ["", "CPU seconds per part of the process tree (trainer process incl. the agent loop; vLLM engine "
              "core + worker; other = sandboxes):", ""]
    for name, s in stages.items():
        if s.get("cpu_s"):
            lines.append(f"- {name}: " + ", ".join(f"{k} {v}" for k, v in sorted(s["cpu_s"].items())))
    lines += ["", "Median seconds per actor step (trainer thread; rollouts run concurrently on the same cores), "
              "with the median 1-minute load average during those steps:", ""]
    for seed, s in summary["seeds"].items():
        lines.append(f"- seed {seed}: "
                     + ", ".join(f"{k.removeprefix('time/')} {v}" for k, v in s["timing_median_s"].items())
                     + f"; log-prob mismatch at lag 0 (median) {s['logprob_mismatch_lag0_median']:.2e}")
    lines += ["", "Per training step (seconds; load = mean 1-minute load average during the step):", "",
              "| seed | step | actor step | reward | critic fwd | critic train | actor train | weight sync "
              "| eval | step | load |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for seed, c in sorted(curves.items()):
        for m in c["metrics"]:
            cell = [f"{m[k]:.1f}" if k in m else ""
                    for k in ("time/critic_forward_s", "time/critic_train_s", "time/actor_train_s",
                              "time/weight_sync_s", "time/eval_s", "step_time_s", "load1")]
            lines.append(f"| {seed} | {m['step']} | {m['step'] + 1 - c['warmup']} | {m['reward']:.3f} | "
                         + " | ".join(cell) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="examples/smollm2_arith.yaml")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--work", default="runs/smollm2/curve")
    p.add_argument("--out", default="results/smollm2")
    p.add_argument("--plot-only", action="store_true", help="only re-draw from the runs already in --work")
    p.add_argument("--paper-critic", action="store_true",
                   help="the paper's critic settings in every train stage (10 warm-up steps, K=2, critic LR 5x)")
    p.add_argument("--no-value-pretrain", action="store_true",
                   help="no value pretraining: the critic starts from the SFT weights")
    p.add_argument("overrides", nargs="*", help="k=v overrides passed to every stage")
    args = p.parse_args(argv)
    work, out = ROOT / args.work, ROOT / args.out
    first = work / f"seed{args.seeds[0]}"
    sft_model = first / "sft_model"
    common = [*args.overrides, "run.console=plain"]
    plan = [("base eval", "eval", [*common, f"run.dir={work}", "--checkpoint", _model_path(args), "--out",
                                   str(work / "base_eval.jsonl")], work),
            ("sft", "sft", [*common, f"run.dir={first}", f"run.seed={args.seeds[0]}", "sft.eval=false"], first)]
    if not args.no_value_pretrain:
        plan.append(("value-pretrain", "value-pretrain", [*common, f"run.dir={first}", f"run.seed={args.seeds[0]}"],
                     first))
    critic = []
    if args.paper_critic:
        from benchmarks.reproduce.critic_presets import paper_critic

        critic = list(paper_critic(args.config, tuple(args.overrides)))
    for seed in args.seeds:
        d = work / f"seed{seed}"
        extra = [] if seed == args.seeds[0] else [f"actor.init={sft_model}"]
        if seed != args.seeds[0] and not args.no_value_pretrain:
            extra.append(f"critic.init={first / 'critic_pretrained'}")
        plan.append((f"train seed {seed}", "train",
                     [*common, f"run.dir={d}", f"run.seed={seed}", *extra, *critic, "--resume"], d))
    stages = {}
    for label, stage, overrides, run_dir in plan:
        if args.plot_only:
            f = run_dir / f"{stage}_stage.json"
            stages[label] = json.loads(f.read_text()) if f.exists() else {}
        else:
            stages[label] = run_stage(stage, args.config, overrides, run_dir, run_dir / f"{stage}.log")
    base = read_jsonl(work / "base_eval.jsonl")
    base_acc = sum(r["correct"] for r in base) / max(len(base), 1)
    curves = {seed: curve_of(work / f"seed{seed}") for seed in args.seeds}
    plot(curves, base_acc, out / "curve.png")
    flags = [f for f, on in (("--paper-critic", args.paper_critic), ("--no-value-pretrain", args.no_value_pretrain))
             if on]
    command = ("make smollm2-curve" if not args.overrides and not flags
               else f"python benchmarks/smollm2_curve.py {' '.join([*flags, *args.overrides])}")
    summary = report(curves, base_acc, stages, out, command)
    print(json.dumps({s: v["eval"] for s, v in summary["seeds"].items()}))
    print(f"smollm2_curve: wrote {out / 'curve.png'}, {out / 'results.md'}, {out / 'summary.json'}")
    return 0


def _model_path(args) -> str:
    from megatron_sao.config import load_config

    return load_config(ROOT / args.config, [o for o in args.overrides if o.startswith("model.")]).model.path


if __name__ == "__main__":
    sys.exit(main())
