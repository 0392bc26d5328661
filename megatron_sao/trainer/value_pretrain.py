"""`sao value-pretrain`: fit the critic on rollouts of the fixed SFT policy before RL.

The paper finds the critic's cold start to be SAO's bottleneck. Here the SFT policy plays
`value_pretrain.rollouts` episodes through the configured rollout engine (vLLM on the SmolLM2
recipe; temperature 1.0), a share of the prompts (`heldout_fraction`) is held out, and the critic
regresses onto the Monte Carlo returns of the rest (skip-observation GAE with the critic's lambda,
bootstrapping truncated episodes from the critic itself), every training trajectory once per epoch.

Before the first step and every `eval_every` steps the critic is scored on the held-out rollouts:
explained variance (overall and per action turn), value mean against return mean, value loss. The
fit stops when the held-out EV has not improved for `patience` evaluations, and the critic written
is the one with the best held-out EV (`<run>/critic_pretrained`, an HF directory with the value head
as `score.weight`, which `sao train` loads by default). Where the environment knows its tasks'
solutions, the task's ceiling (trainer/oracle_value.py) is measured on the same held-out rollouts.

Outputs: `<run>/value_pretrain/metrics.jsonl` (a row per evaluation; "step" counts the optimizer
steps done), the same scalars in TensorBoard and W&B under `<run>/value_pretrain/`
(trainer/scalar_sinks.py), `<run>/value_pretrain/summary.json` (also the stdout's last line, with
what the stage cost: rollouts, seconds, load), the rollouts in `<run>/value_pretrain_rollouts.safetensors`
(`value_pretrain.rollouts_file` fits on those of an earlier run instead).
With `value_pretrain.cache_dir` the critic is looked up first and stored after (trainer/critic_cache.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch

from megatron_sao.algorithms import critic_fit
from megatron_sao.config import SAOConfig, load_config, to_dict
from megatron_sao.distributed.gated import GatedCollectives
from megatron_sao.trainer import components as C
from megatron_sao.trainer import critic_cache
from megatron_sao.trainer.console import Console
from megatron_sao.trainer.hf_export import export_hf_model
from megatron_sao.trainer.losses import critic_loss_fn
from megatron_sao.trainer.run_dir import jsonable
from megatron_sao.trainer.scalar_sinks import stage_sinks
from megatron_sao.trainer.targets import critic_targets, mean_return
from megatron_sao.trainer.value_data import EpochBatches, split_heldout
from megatron_sao.trajectory import collate_padded, save_trajectories

logger = logging.getLogger(__name__)


def rollout_tasks(cfg: SAOConfig, n: int) -> list:
    """The `n` training tasks value pretraining rolls out: a stream seeded apart from RL's."""
    from megatron_sao.rollout.prompts import PromptStream

    stream = PromptStream(C.train_tasks(cfg), cfg.run.seed + 7)
    return [stream[i] for i in range(n)]


def collect_rollouts(cfg: SAOConfig, policy_dir: Path, n: int) -> list:
    from megatron_sao.rollout.agent_loop import run_many
    from megatron_sao.rollout.chat import ChatFormatter

    formatter = ChatFormatter(C.load_tokenizer(cfg, policy_dir))
    tasks = rollout_tasks(cfg, n)

    t0, done = time.monotonic(), [0]

    def progress(traj) -> None:
        done[0] += 1
        if done[0] % 32 == 0 or done[0] == n:
            logger.info("value-pretrain: %d of %d rollouts in %.0f s", done[0], n, time.monotonic() - t0)

    async def go():
        engine = C.build_rollout_engine(cfg, policy_dir)
        try:
            async with C.started_endpoint(cfg, formatter) as endpoint:
                return await run_many(engine, C.env_factory(cfg), tasks, formatter, C.agent_loop_config(cfg),
                                      on_done=progress, endpoint=endpoint)
        finally:
            await engine.close()
    return asyncio.run(go())


def run_value_pretrain(cfg: SAOConfig) -> Path:
    ctx, run = C.start_stage(cfg)
    policy_dir = Path(cfg.actor.init) if cfg.actor.init else run.path / "sft_model"
    if not (policy_dir / "config.json").exists():
        from megatron_sao.errors import MissingInputError

        raise MissingInputError(f"value-pretrain: no policy at {policy_dir}; run `sao sft` first or set actor.init")
    gate = GatedCollectives(ctx)
    key = None
    if cfg.value_pretrain.cache_dir:
        from megatron_sao.checkpoint.digest import dir_digest

        # Rank 0 reads the policy's bytes once; the others take its key.
        key = None
        if ctx.rank == 0:
            key = critic_cache.cache_key(dir_digest(policy_dir), critic_cache.cache_settings(cfg))
        key = gate.broadcast(key, "the critic cache key")
        hit = critic_cache.lookup(cfg.value_pretrain.cache_dir, key)
        if hit is not None:
            return _from_cache(cfg, ctx, run, hit, key)
    sinks = stage_sinks(cfg.run, "value-pretrain", run.path / "value_pretrain", to_dict(cfg), ctx.rank == 0)
    try:
        return _collect_and_fit(cfg, ctx, gate, run, policy_dir, sinks, key)
    finally:
        sinks.close()


def _from_cache(cfg: SAOConfig, ctx, run, hit: Path, key: str) -> Path:
    out = run.path / "critic_pretrained"
    if ctx.rank == 0:
        from megatron_sao.files.atomic_dir import atomic_output_dir

        with atomic_output_dir(out, overwrite=True) as tmp:
            shutil.copytree(hit, tmp, dirs_exist_ok=True)
        entry = json.loads((hit.parent / "entry.json").read_text())
        summary = {**entry.get("summary", {}), "cached": True, "cache_key": key, "cache_entry": str(hit.parent)}
        (run.path / "value_pretrain").mkdir(parents=True, exist_ok=True)
        summary = jsonable(summary)
        (run.path / "value_pretrain" / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False))
        print(json.dumps(summary), flush=True)
    return out


def _rollouts(cfg: SAOConfig, policy_dir: Path) -> list:
    """The SFT policy's rollouts: played now, or read from `value_pretrain.rollouts_file`."""
    f = cfg.value_pretrain.rollouts_file
    if not f:
        return collect_rollouts(cfg, policy_dir, cfg.value_pretrain.rollouts)
    from megatron_sao.errors import UserError
    from megatron_sao.trajectory import TrajectoryFileError, load_trajectories

    if not Path(f).is_file():
        raise UserError(f"value_pretrain.rollouts_file: {f} does not exist")
    try:
        return load_trajectories(f)
    except TrajectoryFileError as e:
        raise UserError(f"value_pretrain.rollouts_file: {e}") from None


def _heldout_fit(critic, batches: list, algo) -> dict[str, float]:
    """critic_fit of the critic's values on every held-out rollout at once, plus the value loss."""
    vs, rs, ts = [], [], []
    for batch in batches:
        fields = {k: t for k, t in batch.to_dict().items() if t.dim() == 2}
        values, _, returns = critic_targets(batch, critic.values(fields), algo)
        mask = batch.action_mask
        vs.append(values[mask])
        rs.append(returns[mask])
        ts.append(batch.turn_ids[mask])
    v, r, t = torch.cat(vs)[None], torch.cat(rs)[None], torch.cat(ts)[None]
    fit = critic_fit(v, r, torch.ones_like(v, dtype=torch.bool), t)
    return {**{f"heldout/{k}": x for k, x in fit.items() if k != "value_mse"},
            "heldout/value_loss": 0.5 * fit["value_mse"]}


class BestState:
    """The trainable parameters at the best held-out EV so far (host copies, this rank's shards)."""

    def __init__(self, module: torch.nn.Module, min_delta: float) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.min_delta = min_delta
        self.ev, self.step, self.saved, self.since = -math.inf, None, None, 0

    def offer(self, ev: float, step: int) -> None:
        if math.isfinite(ev) and ev > self.ev + self.min_delta:
            self.ev, self.step, self.since = ev, step, 0
            self.saved = [p.detach().to("cpu", copy=True) for p in self.params]
        else:
            self.since += 1

    @torch.no_grad()
    def restore(self) -> None:
        if self.saved is not None:
            for p, s in zip(self.params, self.saved):
                p.copy_(s.to(p.device))


def _collect_and_fit(cfg: SAOConfig, ctx, gate, run, policy_dir: Path, sinks, key: str | None) -> Path:
    v, algo = cfg.value_pretrain, cfg.algorithm
    load_start, t0 = os.getloadavg()[0], time.monotonic()
    trajs = _rollouts(cfg, policy_dir) if ctx.rank == 0 else None
    trajs = gate.broadcast(trajs, "the rollouts' broadcast")  # rank 0 collected them alone
    rollout_s = time.monotonic() - t0
    if ctx.rank == 0 and not v.rollouts_file:
        save_trajectories(run.path / "value_pretrain_rollouts.safetensors", trajs)
    usable = [t for t in trajs if t.trainable]
    if len({t.prompt_id for t in usable}) < 2:
        raise RuntimeError(f"value-pretrain: {len(usable)} of {len(trajs)} rollouts are usable, of fewer than 2 "
                           f"prompts (a training and a held-out split need both); first error: {trajs[0].error}")
    train, held = split_heldout(usable, v.heldout_fraction, cfg.run.seed)
    critic = C.build_critic(replace(cfg, critic=cfg.value_pretrain_critic()), policy_dir, ctx=ctx,
                            init=str(policy_dir), freeze=v.apply_critic_freeze, total_steps=v.steps)
    if critic.fresh_value_head and cfg.critic.value_head_bias == "mean_return":
        critic.set_value_head_bias(mean_return(collate_padded(train), algo))
    batches = EpochBatches(train, v.batch_size, cfg.run.seed)
    held_batches = [collate_padded(held[i:i + v.batch_size]) for i in range(0, len(held), v.batch_size)]
    # With lambda 1 and no row bootstrapping from the critic the returns do not depend on the values:
    # the forward that computes them each step would be wasted.
    needs_values = algo.critic_lambda < 1 or any(t.bootstrap in ("critic", "critic_before_stop") for t in train)
    loss_fn, best = critic_loss_fn(), BestState(critic.module, v.min_delta)
    console = Console(cfg.run.console if ctx.rank == 0 else "none", total=v.steps, title="sao value-pretrain")
    metrics_path = run.path / "value_pretrain" / "metrics.jsonl"
    if ctx.rank == 0:
        metrics_path.parent.mkdir(parents=True, exist_ok=True)
        metrics_path.write_text("")
    t_fit, rows, step, last = time.monotonic(), [], 0, {}
    while True:
        if step % v.eval_every == 0 or step == v.steps:
            row = {"step": step, **_heldout_fit(critic, held_batches, algo), **last,
                   "elapsed_s": time.monotonic() - t_fit}
            best.offer(row["heldout/explained_variance"], step)
            rows.append(row)
            if ctx.rank == 0:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(jsonable(row), allow_nan=False) + "\n")
            sinks.write(row, step)
            console.update({"step": step, "critic/heldout_ev": row["heldout/explained_variance"]})
            if step == v.steps or (v.patience and best.since >= v.patience):
                break
        batch = collate_padded(batches.next())
        fields = {k: t for k, t in batch.to_dict().items() if t.dim() == 2}
        values = critic.values(fields) if needs_values else torch.zeros(batch.tokens.shape, dtype=torch.float32)
        fields["returns"] = critic_targets(batch, values, algo)[2]
        res = critic.train_step(fields, loss_fn)
        step += 1
        last = {"train/value_loss": res.loss, "train/grad_norm": res.grad_norm, "epoch": batches.epoch,
                **{f"train/{k}": x for k, x in res.metrics.items() if k.startswith("grad_norm/") or k == "lr"}}
    console.close()
    fit_s = time.monotonic() - t_fit
    best.restore()  # the critic of the best held-out EV (the last one when none was finite)
    out = run.path / "critic_pretrained"
    export_hf_model(critic, policy_dir, out)
    if ctx.rank != 0:
        return out
    summary = _summary(cfg, trajs, usable, train, held, rows, best, rollout_s, fit_s, load_start)
    summary["ceiling"] = task_ceiling(cfg, policy_dir, train, held)
    if summary["ceiling"] is not None and summary["ceiling"]["explained_variance"] > 0:
        summary["ev_fraction_of_ceiling"] = summary["ev_heldout_best"] / summary["ceiling"]["explained_variance"]
    summary = jsonable(summary)
    if key is not None:
        summary["cache_key"] = key
        entry = {"settings": critic_cache.cache_settings(cfg), "policy": str(policy_dir), "summary": summary}
        critic_cache.store(cfg.value_pretrain.cache_dir, key, out, entry)
    (run.path / "value_pretrain" / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False))
    print(json.dumps(summary), flush=True)
    return out


def _summary(cfg, trajs, usable, train, held, rows, best: BestState, rollout_s, fit_s, load_start) -> dict:
    final = rows[-1]
    kept = next((r for r in rows if r["step"] == best.step), final)
    return {"stage": "value-pretrain", "rollouts": len(trajs), "usable": len(usable), "train_trajectories": len(train),
            "heldout_trajectories": len(held), "rollout_reward": sum(t.reward for t in usable) / len(usable),
            "rollout_s": round(rollout_s, 1), "fit_s": round(fit_s, 1), "steps_run": final["step"],
            "stopped_early": final["step"] < cfg.value_pretrain.steps, "best_step": kept["step"],
            "ev_step0": rows[0]["heldout/explained_variance"], "ev_heldout_best": kept["heldout/explained_variance"],
            "heldout_value_mean": kept["heldout/value_mean"], "heldout_return_mean": kept["heldout/return_mean"],
            "heldout_value_loss": kept["heldout/value_loss"],
            "final_value_loss": final.get("train/value_loss"),
            "final_explained_variance": kept["heldout/explained_variance"],
            "load1_start": load_start, "load1_end": os.getloadavg()[0]}


def task_ceiling(cfg: SAOConfig, policy_dir: Path, train, held) -> dict | None:
    """The oracle's held-out EV (trainer/oracle_value.py) where the environment has reference solutions."""
    from megatron_sao.envs.registry import reference_actions_of
    from megatron_sao.trainer.oracle_value import oracle_ceiling

    refs = reference_actions_of(cfg.env.name)
    if refs is None:
        return None
    source = C.train_tasks(cfg)
    tasks = {t.prompt_id: t for t in (source[i] for i in range(len(source)))}
    tok = C.load_tokenizer(cfg, policy_dir)
    res = oracle_ceiling(train, held, lambda t: refs(tasks[t.prompt_id]), tok.decode, cfg.algorithm)
    return {"explained_variance": res.explained_variance, "fit": res.fit, "keys": res.keys}


def main(args) -> int:
    run_value_pretrain(load_config(args.config, args.overrides))
    return 0
