"""`sao value-pretrain`: fit the critic on rollouts of the fixed SFT policy before RL.

The paper finds the critic's cold start to be SAO's bottleneck: a critic that starts from the
policy's weights with a fresh value head gives noisy advantages for the first hundreds of steps.
Here the SFT policy plays `value_pretrain.rollouts` episodes (temperature 1.0), and the critic
regresses onto their Monte Carlo returns (skip-observation GAE with lambda = 1, bootstrapping
truncated episodes from the critic itself). The critic is written as an HF directory
`<run>/critic_pretrained` (value head as `score.weight`), which `sao train` loads by default.
Each step's scalars go to `<run>/value_pretrain_metrics.jsonl` and, through the one fan-out
(trainer/scalar_sinks.py), to TensorBoard and W&B under `<run>/value_pretrain/`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from pathlib import Path

from megatron_sao.algorithms import explained_variance
from megatron_sao.config import SAOConfig, load_config, to_dict
from megatron_sao.distributed.gated import GatedCollectives
from megatron_sao.trainer import components as C
from megatron_sao.trainer.console import Console
from megatron_sao.trainer.hf_export import export_hf_model
from megatron_sao.trainer.losses import critic_loss_fn
from megatron_sao.trainer.scalar_sinks import stage_sinks
from megatron_sao.trainer.targets import critic_targets
from megatron_sao.trajectory import collate_padded, save_trajectories

logger = logging.getLogger(__name__)


def collect_rollouts(cfg: SAOConfig, policy_dir: Path, n: int) -> list:
    from megatron_sao.rollout.agent_loop import run_many
    from megatron_sao.rollout.chat import ChatFormatter
    from megatron_sao.rollout.prompts import PromptStream

    formatter = ChatFormatter(C.load_tokenizer(cfg, policy_dir))
    stream = PromptStream(C.train_tasks(cfg), cfg.run.seed + 7)
    tasks = [stream[i] for i in range(n)]

    async def go():
        engine = C.build_rollout_engine(cfg, policy_dir)
        try:
            async with C.started_endpoint(cfg, formatter) as endpoint:
                return await run_many(engine, C.env_factory(cfg), tasks, formatter, C.agent_loop_config(cfg),
                                      endpoint=endpoint)
        finally:
            await engine.close()
    return asyncio.run(go())


def run_value_pretrain(cfg: SAOConfig) -> Path:
    ctx, run = C.start_stage(cfg)
    policy_dir = Path(cfg.actor.init) if cfg.actor.init else run.path / "sft_model"
    if not (policy_dir / "config.json").exists():
        from megatron_sao.errors import MissingInputError

        raise MissingInputError(f"value-pretrain: no policy at {policy_dir}; run `sao sft` first or set actor.init")
    sinks = stage_sinks(cfg.run, "value-pretrain", run.path / "value_pretrain", to_dict(cfg), ctx.rank == 0)
    try:
        return _collect_and_fit(cfg, ctx, run, policy_dir, sinks)
    finally:
        sinks.close()


def _collect_and_fit(cfg: SAOConfig, ctx, run, policy_dir: Path, sinks) -> Path:
    v = cfg.value_pretrain
    trajs = collect_rollouts(cfg, policy_dir, v.rollouts) if ctx.rank == 0 else None
    trajs = GatedCollectives(ctx).broadcast(trajs, "the rollouts' broadcast")  # rank 0 collected them alone
    if ctx.rank == 0:
        save_trajectories(run.path / "value_pretrain_rollouts.safetensors", trajs)
    usable = [t for t in trajs if t.trainable]
    if not usable:
        raise RuntimeError(f"value-pretrain: all {len(trajs)} rollouts failed; first error: {trajs[0].error}")
    if v.lr is not None:
        cfg.critic.optim.lr = v.lr
    critic = C.build_critic(cfg, policy_dir, ctx=ctx, init=str(policy_dir), freeze=v.apply_critic_freeze,
                            total_steps=v.steps)
    rng = random.Random(cfg.run.seed)
    loss_fn = critic_loss_fn()
    console = Console(cfg.run.console if ctx.rank == 0 else "none", total=v.steps, title="sao value-pretrain")
    log = []
    for step in range(v.steps):
        batch = collate_padded([usable[rng.randrange(len(usable))] for _ in range(min(v.batch_size, len(usable)))])
        fields = {k: t for k, t in batch.to_dict().items() if t.dim() == 2}
        # The critic's targets do not depend on the policy's algorithm (grpo, running_mean...).
        old_values, _, returns = critic_targets(batch, critic.values(fields), cfg.algorithm)
        fields["returns"] = returns
        res = critic.train_step(fields, loss_fn)
        ev = float(explained_variance(old_values, returns, batch.action_mask))
        log.append({"step": step, "value_loss": res.loss, "explained_variance": ev, "grad_norm": res.grad_norm})
        sinks.write(log[-1], step)
        console.update({"step": step, "critic/loss": res.loss, "critic/explained_variance": ev})
    console.close()
    out = run.path / "critic_pretrained"
    export_hf_model(critic, policy_dir, out)
    if ctx.rank == 0:
        (run.path / "value_pretrain_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
        print(json.dumps({"stage": "value-pretrain", "rollouts": len(trajs), "usable": len(usable),
                          "rollout_reward": sum(t.reward for t in usable) / len(usable),
                          "final_value_loss": log[-1]["value_loss"] if log else None,
                          "final_explained_variance": log[-1]["explained_variance"] if log else None}), flush=True)
    return out


def main(args) -> int:
    run_value_pretrain(load_config(args.config, args.overrides))
    return 0
