"""One trainer step's peak memory on CPU against `sao plan`'s estimate of it (cluster/planner.py).

Usage: python -m tests.cluster.workers.train_step_peak <recompute: none|full>   (run with MALLOC_MMAP_THRESHOLD_=65536)
One rank, fp32, the local layer spec (what `sao plan --no-te` counts: unfused attention): a small
Qwen3-MoE with a real-sized vocabulary, actor and critic built as the trainer builds them, then
critic values, two critic and two actor train steps on a batch of rows of max_seq_len tokens carrying
every field the trainer's batch has. glibc serves every allocation over 64 KiB with its own mmap
(MALLOC_MMAP_THRESHOLD_), so the resident set follows the live tensors; the figure is the peak
resident set (ru_maxrss) minus the resident set before the engines exist. The log-prob pass runs the
chunk the planner counts (a GPU's, `DEFAULT_CHUNK_TOKENS` rows) instead of the CPU's cache-sized one.
Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import resource
import sys

import torch

from megatron_sao.megatron.cpu_compat import ensure_cpu_compat

torch.set_num_threads(1)
ensure_cpu_compat()

from megatron_sao.cluster import memory as mem  # noqa: E402
from megatron_sao.cluster.planner import PlanOptions, plan  # noqa: E402
from megatron_sao.config import config_from_dict  # noqa: E402
from megatron_sao.megatron import logprobs  # noqa: E402
from megatron_sao.megatron.engine import InitSource, MegatronEngine  # noqa: E402
from megatron_sao.megatron.optimizer import OptimConfig  # noqa: E402
from megatron_sao.megatron.parallel import init_parallel  # noqa: E402
from megatron_sao.models.hf_config import model_spec_from_hf  # noqa: E402
from megatron_sao.models.parallel_sizes import ParallelSizes  # noqa: E402
from megatron_sao.models.presets import tiny_hf_config  # noqa: E402
from megatron_sao.models.vocab import padded_vocab_size  # noqa: E402
from megatron_sao.trainer.components import engine_overrides  # noqa: E402

SEQ, ROWS, MICRO = 1024, 4, 2


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(recompute: str) -> None:
    spec = model_spec_from_hf(tiny_hf_config("qwen3_moe", hidden_size=256, vocab_size=32000, head_dim=64,
                                             max_position_embeddings=SEQ))
    cfg = config_from_dict({}, ["model.dtype=float32", f"model.max_seq_len={SEQ}", f"parallel.micro_batch_size={MICRO}",
                                f"parallel.recompute={recompute}", f"buffer.batch_size={ROWS}", "critic.freeze=[]",
                                "cluster.trainer_nodes=1", "cluster.gpus_per_node=1",
                                f"rollout.max_total_tokens={SEQ}"])
    planned = plan(cfg, spec, PlanOptions(world=1, overhead_gib=0.0, transformer_engine=False))
    logprobs.CPU_CHUNK_BYTES = logprobs.DEFAULT_CHUNK_TOKENS * padded_vocab_size(spec.vocab_size, 1) * 4
    ctx = init_parallel(ParallelSizes())
    g = torch.Generator().manual_seed(0)
    ones = torch.ones(ROWS, SEQ, dtype=torch.bool)
    rand = lambda: torch.randn(ROWS, SEQ, generator=g)  # noqa: E731
    zeros = lambda dtype: torch.zeros(ROWS, SEQ, dtype=dtype)  # noqa: E731
    batch = dict(tokens=torch.randint(0, spec.vocab_size, (ROWS, SEQ), generator=g), attention_mask=ones,
                 action_mask=ones.clone(), lag0_mask=ones.clone(), versions=zeros(torch.int64),
                 turn_ids=zeros(torch.int64), rollout_logprobs=rand(), rewards=zeros(torch.float32),
                 advantages=rand(), returns=rand())
    base = rss()
    kw = dict(init=InitSource.random(0), micro_batch_size=MICRO, ctx=ctx, config_overrides=engine_overrides(cfg))
    actor = MegatronEngine(spec, ParallelSizes(), OptimConfig(lr=1e-6), role="actor", **kw)
    critic = MegatronEngine(spec, ParallelSizes(), OptimConfig(lr=1e-6), role="critic", **kw)

    def nll(out, mb, denom):
        return -(out * mb["action_mask"]).sum() / denom, {}

    def mse(out, mb, denom):
        return ((out - mb["returns"]) ** 2 * mb["action_mask"]).sum() / denom, {}

    critic.values(batch)
    # Two steps each: the steady state the planner counts. With one rank the engines use Megatron's
    # plain optimizers, whose torch Adam creates its state at the first step, after that step's peak.
    for _ in range(2):
        critic.train_step(batch, mse)
        actor.train_step(batch, nll)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("PEAK " + json.dumps({"measured_gib": (peak - base) / mem.GIB, "planned_gib": planned.trainer_peak / mem.GIB,
                                "static_gib": planned.trainer_static / mem.GIB,
                                "logits_gib": planned.actor.logits / mem.GIB,
                                "activations_gib": (planned.actor.activations_recompute if recompute == "full"
                                                    else planned.actor.activations) / mem.GIB,
                                "buffers_gib": planned.step_buffers / mem.GIB}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
