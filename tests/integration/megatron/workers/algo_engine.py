"""Engine-level checks of the algorithm's choices. Usage:
    python -m tests.integration.megatron.workers.algo_engine <tmp_dir> single                 (world size 1)
    torchrun --nproc_per_node 2 -m tests.integration.megatron.workers.algo_engine <tmp_dir> tp2sp_ep2 pp2

For each layout: the critic as `sao train` builds it (components.build_critic, default config):
which parameters the frozen-attention preset freezes, the whole-model parameter counts per group
(must not depend on the layout), the LR schedule's length, and that frozen tensors stay put through
two train steps on every rank. With `single` also: vanilla GRPO's update equals the one computed with
an explicit old-policy forward at the start of the step. Rank 0 prints RESULT lines.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# engine_common first: it applies the CPU patches before any Megatron module is imported.
from tests.integration.megatron.workers.engine_common import emit, make_batch, mse_loss, tiny_model_dir

# isort: split
from megatron_sao.algorithms import ppo_clip_loss
from megatron_sao.config import AlgorithmConfig, load_config
from megatron_sao.megatron.engine import InitSource, MegatronEngine
from megatron_sao.megatron.optimizer import OptimConfig
from megatron_sao.megatron.parallel import destroy_parallel, init_parallel
from megatron_sao.models.names import canonical_name
from megatron_sao.models.parallel_sizes import ParallelSizes
from megatron_sao.trainer import components as C
from megatron_sao.trainer.losses import policy_loss_fn

LAYOUTS = {
    "single": [],
    "tp2sp_ep2": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2", "parallel.etp=1"],
    "pp2": ["parallel.pp=2"],
}
SCHEDULE = ["critic.optim.lr=1e-2", "critic.optim.min_lr=1e-4", "algorithm.critic_warmup_steps=3",
            "run.total_steps=5", "algorithm.critic_steps=2", "parallel.micro_batch_size=2"]

tmp = sys.argv[1]
names = sys.argv[2:]
if "RANK" in os.environ:
    dist.init_process_group("gloo")
rank = int(os.environ.get("RANK", 0))
hf_dir = os.path.join(tmp, "hf")
spec, _ = tiny_model_dir(hf_dir)
batch = make_batch(spec.vocab_size, rows=4)


def snapshot(engine):
    return {canonical_name(n): p.detach().clone() for n, p in engine.module.named_parameters()}


for layout in names:
    cfg = load_config(None, [*LAYOUTS[layout], *SCHEDULE])
    ctx = init_parallel(C.parallel_sizes(cfg))
    critic = C.build_critic(cfg, Path(hf_dir), ctx=ctx)
    params = dict(critic.module.named_parameters())
    frozen = sorted(canonical_name(n) for n, p in params.items() if not p.requires_grad)
    before = snapshot(critic)
    # Two steps: the default zero value head passes no gradient to the experts in the first (its weight
    # is 0); the first step moves the head, the second the experts.
    res = [critic.train_step(batch, mse_loss) for _ in range(2)]
    after = snapshot(critic)
    moved = {n: float((after[n] - before[n]).abs().max()) for n in after}
    frozen_moved = torch.tensor([max((moved[n] for n in frozen), default=0.0)])
    trainable_still = torch.tensor([float(sum(1 for n in moved if n not in frozen and moved[n] == 0.0))])
    if dist.is_initialized():
        dist.all_reduce(frozen_moved, op=dist.ReduceOp.MAX)
        dist.all_reduce(trainable_still)
    if rank == 0:
        emit(layout, {"counts": getattr(critic, "param_counts", None), "frozen": frozen,
                      "trainable": sorted(canonical_name(n) for n, p in params.items() if p.requires_grad),
                      "decay_steps": critic.optim_config.decay_steps, "skipped": any(r.skipped for r in res),
                      "frozen_max_change": float(frozen_moved), "trainable_unchanged": int(trainable_still)})
    del critic
    destroy_parallel(destroy_process_group=False)

if "single" in names:
    # Vanilla GRPO: the trainer's loss (detached log-probs of the step's own forward) against PPO
    # with the old policy's log-probs from an explicit forward before the update.
    ctx = init_parallel(ParallelSizes())

    def actor():
        return MegatronEngine(spec, ParallelSizes(), OptimConfig(lr=1e-2), role="actor",
                              init=InitSource.from_hf(hf_dir), micro_batch_size=2, ctx=ctx)

    algo = AlgorithmConfig(name="grpo")
    explicit, ours = actor(), actor()
    start = snapshot(explicit)
    old = dict(batch, old_logprobs=explicit.logprobs(batch))
    r1 = explicit.train_step(old, lambda lp, mb, d: ppo_clip_loss(
        lp, mb["old_logprobs"], mb["advantages"], mb["action_mask"].bool(), algo.ppo_clip_low, algo.ppo_clip_high,
        loss_denominator=d))
    garbage = dict(batch, rollout_logprobs=torch.full_like(batch["rollout_logprobs"], -30.0))
    r2 = ours.train_step(garbage, policy_loss_fn(algo))
    a, b = snapshot(explicit), snapshot(ours)
    emit("vanilla_grpo", {
        "param_max_abs_diff": max(float((a[n] - b[n]).abs().max()) for n in a),
        "param_change": max(float((a[n] - start[n]).abs().max()) for n in a),
        "loss": [r1.loss, r2.loss], "clip_fraction": [r1.metrics["clip_fraction"], r2.metrics["clip_fraction"]]})
print("ALGO_ENGINE DONE", flush=True)
