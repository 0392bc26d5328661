"""Starting points shared by every experiment: an SFT policy and a value-pretrained critic.

Every RL run of an experiment starts from the same SFT model and pretrained critic (the paper's
recipe: warm start, then value pretraining on the fixed SFT policy's rollouts). Seeds vary the RL
phase (prompt order, sampling, critic head noise), not the starting point: the comparison is between
RL methods, so they must start from the same policy. The starting point's own accuracy is measured
with `sao eval` on the same held-out tasks (`env.eval_seed`) that every run's evaluations use.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from benchmarks.reproduce.runner import ROOT, Run, execute

TOY_CONFIG = "examples/tiny_cpu.yaml"
TOY_QUICK_CONFIG = "benchmarks/reproduce/configs/toy_quick.yaml"
STYLE_CONFIG = "examples/style_shift_cpu.yaml"
SMOLLM2_STYLE_CONFIG = "examples/smollm2_style.yaml"
STYLE_QUICK_OVERRIDES = ("model.path=tiny_qwen3_moe_ci", "sft.steps=3", "sft.batch_size=8", "sft.demonstrations=64",
                         "sft.eval=false", "value_pretrain.rollouts=8", "value_pretrain.steps=2",
                         "value_pretrain.batch_size=8")
EVAL_SEED = 7  # one held-out task set for every run and seed


@dataclass
class Start:
    name: str
    config: str
    dir: Path
    stage_overrides: tuple[str, ...]  # overrides the sft / value-pretrain stages ran with
    wall_s: float

    @property
    def sft_model(self) -> Path:
        return self.dir / "sft_model"

    @property
    def critic(self) -> Path:
        return self.dir / "critic_pretrained"

    def rl_overrides(self, eval_size: int) -> tuple[str, ...]:
        """What every RL run from this start adds: its weights, the shared eval tasks, quiet logs."""
        return (*self.stage_overrides, f"actor.init={self.sft_model}", f"critic.init={self.critic}",
                f"env.eval_seed={EVAL_SEED}", f"env.eval_size={eval_size}", "run.save_every=0",
                "run.tensorboard=false")

    def evaluate_sft(self, eval_size: int, log=print) -> dict:
        """Pass@1 of the SFT model on the shared eval tasks (cached in the start directory)."""
        out = self.dir / f"sft_eval_seed{EVAL_SEED}_n{eval_size}.json"
        if out.exists():
            return json.loads(out.read_text())
        cmd = [sys.executable, "-m", "megatron_sao.cli", "eval", self.config, *self.stage_overrides,
               f"run.dir={self.dir}", f"env.eval_seed={EVAL_SEED}", f"env.eval_size={eval_size}",
               "--checkpoint", str(self.sft_model), "--out", str(self.dir / "eval" / f"sft_n{eval_size}.jsonl")]
        log(f"  eval  SFT model on {eval_size} held-out tasks")
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1)})
        if p.returncode != 0:
            raise RuntimeError(f"sao eval of {self.sft_model} failed:\n{p.stderr[-3000:]}")
        res = json.loads(p.stdout.strip().splitlines()[-1])
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res))
        tmp.replace(out)
        return res


def _build(name: str, config: str, overrides: tuple[str, ...], work: Path, log=print,
           threads: int | None = None, pin: Path | None = None) -> Start:
    key = Run(name, 1, config, overrides, stage="sft").key()
    d = work / "starts" / f"{name}-{key}"
    if pin is not None and is_pinned(pin):
        restore_pin(pin, d, log)
    threads = threads or os.cpu_count() or 1
    wall = 0.0
    for stage in ("sft", "value-pretrain"):
        res = execute(Run(name, 1, config, overrides, stage=stage, run_dir=str(d)), work, threads=threads, log=log)
        if not res.ok:
            raise RuntimeError(f"starting point {name}: `sao {stage}` failed; log in {d}/{stage}.log\n{res.error}")
        wall += res.wall_s
    return Start(name, config, d, overrides, wall)


def require_model(config: str) -> None:
    """The model the config trains must exist; say how to build SmolLM2's rather than fail in `sao sft`."""
    from megatron_sao.config import load_config
    from megatron_sao.models.builtin import is_builtin

    path = load_config(ROOT / config, []).model.path
    if not is_builtin(path) and not ((ROOT / path) / "config.json").is_file():
        raise SystemExit(f"sao bench --model smollm2: {ROOT / path}/config.json is missing: the model.path "
                         f"of {config}; build SmolLM2-135M-Instruct there with `make smollm2` (about 40 s, no hub "
                         "download)")


def toy_start(quick: bool, work: Path, log=print, threads: int | None = None, pin: Path | None = None) -> Start:
    """The toy multi-turn calculator task (examples/tiny_cpu.yaml: the `make demo` recipe). With `pin`,
    the starting point pinned there (pin_start) is used instead of training one."""
    return _build("toy", TOY_QUICK_CONFIG if quick else TOY_CONFIG, (), work, log, threads, pin)


# A starting point pinned in a results folder: the SFT policy, the pretrained critic, the SFT model's
# evaluations and the stages' records (runner.py counts a stage done by its artefact and its record).
# An experiment spread over sessions needs every run to start from the same weights, and
# `sao sft` is not bit-reproducible across CPUs (the kernels' rounding differs: the toy SFT model scored
# 0.605 on one machine and 0.615 on another from the same config), so the weights themselves are kept
# beside the results (8 MB for the toy) and a later session trains from them instead of rebuilding.
PINNED_DIRS = ("sft_model", "critic_pretrained")


def is_pinned(pin: Path) -> bool:
    return all((pin / d / "config.json").is_file() for d in PINNED_DIRS)


def pin_start(start: Start, pin: Path) -> None:
    """Keep `start`'s weights and SFT evaluations in `pin` (once: an existing pin is never replaced)."""
    if is_pinned(pin):
        return
    tmp = pin.with_name(pin.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for d in PINNED_DIRS:
        shutil.copytree(start.dir / d, tmp / d)
    for f in (*start.dir.glob("sft_eval_*.json"), *start.dir.glob("reproduce_*.json")):  # evals; stages' records
        shutil.copy2(f, tmp / f.name)
    shutil.rmtree(pin, ignore_errors=True)
    tmp.rename(pin)


def restore_pin(pin: Path, d: Path, log=print) -> None:
    """The pinned weights into the start directory `d`, where its stages find them done."""
    d.mkdir(parents=True, exist_ok=True)
    missing = [item for item in sorted(pin.iterdir()) if not (d / item.name).exists()]
    if missing:
        log(f"  start {d.name}: {', '.join(i.name for i in missing)} from the pinned start in {pin}")
    for item in missing:
        if item.is_dir():
            tmp = d / f".{item.name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(item, tmp)
            tmp.rename(d / item.name)
        else:
            shutil.copy2(item, d / item.name)


def style_start(quick: bool, work: Path, log=print, threads: int | None = None) -> Start:
    """The online style-shift task (examples/style_shift_cpu.yaml)."""
    return _build("style", STYLE_CONFIG, STYLE_QUICK_OVERRIDES if quick else (), work, log, threads)


def smollm2_style_start(quick: bool, work: Path, log=print, threads: int | None = None) -> Start:
    """The style-shift task on SmolLM2-135M-Instruct (examples/smollm2_style.yaml); `quick`: the toy's
    quick start, the same pipeline at toy scale."""
    if quick:
        return style_start(quick, work, log, threads)
    require_model(SMOLLM2_STYLE_CONFIG)
    return _build("smollm2_style", SMOLLM2_STYLE_CONFIG, (), work, log, threads)


def build_all(quick: bool, work: Path, eval_size: int, log=print) -> None:
    """Both starting points and the toy SFT model's eval, the two chains side by side (`bench all`).

    They are independent, and each stage is mostly one process's single-threaded start-up, so one
    after the other they would leave a core idle. The experiments then find them in the cache; they
    must not run while a chain is still building (two `sao sft` in one directory)."""
    threads = max(1, (os.cpu_count() or 1) // 2)
    with ThreadPoolExecutor(2) as pool:
        toy = pool.submit(lambda: toy_start(quick, work, log, threads).evaluate_sft(eval_size, log))
        style = pool.submit(style_start, quick, work, log, threads)
        toy.result()
        style.result()
