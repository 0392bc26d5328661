"""The weight-sync check under routing replay, on 2 gloo ranks with EP=2 (rank 0 holds the rollout side,
rank 1 joins the check's forward when rank 0 asks).
Usage: torchrun --nproc_per_node 2 -m tests.integration.megatron.workers.weight_check_replay <tmp_dir>

The tiny Qwen3-MoE as the Megatron actor (fp32) and as two rollout engines with the same weights whose
routers choose other experts than the actor's: a forward hook makes each HF router take its 2nd..k+1-th
best experts (their own probabilities there, renormalised), a stack that routes otherwise with equal
weights. One is in process (HFEngine: the embedded placement), one is served over HTTP
(rollout/engines/http_server.py + VLLMServerClient: the disaggregated client). One `RolloutSide` holds
both; `WeightPush` pushes the actor's weights with `rollout.weight_sync_check` on:
- `replay_on`: the check's reference replays each engine's routes of the check tokens;
- `replay_off`: free routing in the reference, measured (atol 100) and with the real atol (it fails);
- `corrupt_on`: replay on, one expert tensor corrupted in transfer: the check still fails.
Prints RESULT lines parsed by tests/integration/megatron/test_weight_check_replay.py.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import torch

# engine_common first: it applies the CPU patches before any Megatron module is imported.
from tests.integration.megatron.workers.engine_common import emit, tiny_model_dir

# isort: split
from megatron_sao.distributed.gated import GatedCollectives
from megatron_sao.errors import TrainingStopped
from megatron_sao.megatron.engine import InitSource, MegatronEngine
from megatron_sao.megatron.optimizer import OptimConfig
from megatron_sao.megatron.parallel import init_parallel
from megatron_sao.models.parallel_sizes import ParallelSizes
from megatron_sao.rollout.agent_loop import AgentLoopConfig
from megatron_sao.rollout.engines.hf_engine import HFEngine
from megatron_sao.rollout.engines.http_server import start_server
from megatron_sao.rollout.engines.protocol import EngineConfig
from megatron_sao.rollout.engines.vllm_server_client import VLLMServerClient
from megatron_sao.rollout.prompts import PromptStream
from megatron_sao.rollout.rollout_side import RolloutSide, RolloutSideConfig
from megatron_sao.weights.push import WeightPush

ATOL = 1e-4


def routes_otherwise(module, args, out):
    """The router's 2nd..k+1-th best experts instead of its top-k, weighted by its own probabilities."""
    logits, scores, own = out
    k = own.shape[-1]
    idx = logits.float().topk(k + 1, dim=-1).indices[:, 1:]
    probs = torch.softmax(logits.float(), dim=-1).gather(1, idx)
    if module.norm_topk_prob:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return logits, probs.to(scores.dtype), idx


def engine(hf_dir: str, name: str) -> HFEngine:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    for m in model.modules():  # before HFEngine's own hook, which records what the router returned
        if type(m).__name__.endswith("TopKRouter"):
            m.register_forward_hook(routes_otherwise)
    return HFEngine(model, max_model_len=256, name=name)


def push(tag: str, weights: WeightPush, side: RolloutSide | None, version: int, atol: float) -> None:
    if side is not None:
        side.sync.atol = atol
    weights.actor.last_routing_agreement = None  # set by a forward with routes (the replayed check's)
    out: dict = {}
    try:
        weights.push(version, step=version)
        if side is not None:
            out["diff"] = dict(side.last_sync.logprob_diff)
    except TrainingStopped as e:
        out["error"] = str(e)
    out.update(weights.actor.last_routing_agreement or {})
    emit(f"{tag}_rank{ctx.rank}", out)


def rollout_side(hf_dir: str):
    """Rank 0's rollout side: the embedded engine and the HTTP client of the served one."""
    served = engine(hf_dir, "served")
    server_loop = asyncio.new_event_loop()  # the server lives on a loop of its own, like another process
    threading.Thread(target=server_loop.run_forever, daemon=True).start()
    runner, port = asyncio.run_coroutine_threadsafe(start_server(served), server_loop).result(60)
    url = f"http://127.0.0.1:{port}"
    client = VLLMServerClient(url, EngineConfig(backend="vllm_server", model_path=hf_dir, server_urls=(url,),
                                                weight_transport="reload"))
    # No episodes (0 trajectories a step): the rollout side only carries the weight updates here.
    side = RolloutSide([engine(hf_dir, "embedded"), client], lambda task: None, PromptStream(["unused"], 0), None,
                       AgentLoopConfig(), lambda traj: None,
                       RolloutSideConfig(batch_size=0, ahead=0, concurrency=1, check_weights=True, check_atol=ATOL,
                                         health_interval_s=0),
                       labels=["embedded", "http"])
    side.start()

    def close() -> None:
        side.close()
        asyncio.run_coroutine_threadsafe(runner.cleanup(), server_loop).result(60)
        asyncio.run_coroutine_threadsafe(served.close(), server_loop).result(60)
        server_loop.call_soon_threadsafe(server_loop.stop)
    return side, close


tmp = sys.argv[1]
hf_dir = os.path.join(tmp, "hf")
torch.distributed.init_process_group("gloo")
spec, _ = tiny_model_dir(hf_dir)
sizes = ParallelSizes(ep=2, etp=1)
ctx = init_parallel(sizes)
actor = MegatronEngine(spec, sizes, OptimConfig(lr=1e-6), role="actor", init=InitSource.from_hf(hf_dir),
                       micro_batch_size=2, ctx=ctx)
side, close = rollout_side(hf_dir) if ctx.rank == 0 else (None, lambda: None)
weights = WeightPush(actor, side, GatedCollectives(ctx), bucket_bytes=1 << 20, check=True)
try:
    actor.replay_routes = True
    push("replay_on", weights, side, 1, ATOL)
    actor.replay_routes = False
    push("replay_off_measured", weights, side, 2, 100.0)
    push("replay_off", weights, side, 3, ATOL)

    actor.replay_routes = True
    export = actor.export_hf_weights

    def corrupted(bucket_bytes):
        for bucket in export(bucket_bytes):
            yield [(n, t + 0.05 if "layers.1.mlp.experts.0.down_proj" in n else t) for n, t in bucket]
    actor.export_hf_weights = corrupted
    push("corrupt_on", weights, side, 4, ATOL)
finally:
    close()
torch.distributed.barrier()
if ctx.rank == 0:
    print("WEIGHT CHECK REPLAY DONE", flush=True)
