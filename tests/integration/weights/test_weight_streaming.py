"""Weight export streams: the trainer never holds more than two buckets, and every server has bucket k
before the trainer produces bucket k+2.

The export is a counting stand-in for `MegatronEngine.export_hf_weights` (the boundary): it yields fresh
tensors per bucket and watches them with weakref finalizers, so "alive" means "still referenced by
anyone" (the trainer loop, WeightSync, a client, an engine). The servers are real: two HTTP rollout
servers (rollout/engines/http_server.py over an HFEngine) and one in-process HFEngine, all updated by one
`RolloutSide` while its episodes run, with the check mode comparing every server's log-probs with the
new weights afterwards.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import types
import weakref

import pytest
import torch

from tests.engine_fixtures import hf_logprobs, load_checkpoint, make_tiny_model, perturbed

pytest.importorskip("aiohttp")

from megatron_sao.envs import make_env
from megatron_sao.envs.toy_tool import ToyToolTasks
from megatron_sao.rollout.agent_loop import AgentLoopConfig
from megatron_sao.rollout.chat import ChatFormatter
from megatron_sao.rollout.engines.hf_engine import HFEngine
from megatron_sao.rollout.engines.http_server import start_server
from megatron_sao.rollout.engines.protocol import EngineConfig, SamplingParams
from megatron_sao.rollout.engines.vllm_server_client import VLLMServerClient
from megatron_sao.rollout.prompts import PromptStream
from megatron_sao.rollout.rollout_side import RolloutSide, RolloutSideConfig
from megatron_sao.tokenizers.char_tokenizer import build_char_tokenizer

pytestmark = pytest.mark.timeout(600)


class LiveBuckets:
    """Yields `state` in buckets of fresh tensors; records when each is produced and how many are alive."""

    def __init__(self, state: dict[str, torch.Tensor], per_bucket: int) -> None:
        names = list(state)
        self.state = state
        self.chunks = [names[i:i + per_bucket] for i in range(0, len(names), per_bucket)]
        self.index = {c[0]: k for k, c in enumerate(self.chunks)}
        self.lock = threading.Lock()
        self.live: dict[int, int] = {}  # bucket -> tensors of it still alive
        self.max_live_buckets = 0
        self.events: list[tuple] = []

    def _freed(self, k: int) -> None:
        with self.lock:
            self.live[k] -= 1
            if not self.live[k]:
                del self.live[k]

    def __iter__(self):
        for k, names in enumerate(self.chunks):
            self.events.append(("produced", k))
            # Count what code holds, not what waits for the cyclic collector: with gc disabled during the
            # push a sent bucket outlives its send (reachable only from reference cycles, which the HTTP
            # reload path's serialization leaves behind), and the count depended on when gc last ran.
            gc.collect()
            bucket = [(n, self.state[n].clone()) for n in names]
            with self.lock:
                self.live[k] = len(bucket)
                self.max_live_buckets = max(self.max_live_buckets, len(self.live))
            for _, t in bucket:
                weakref.finalize(t, self._freed, k)
            yield bucket
            bucket = None


def record_receipts(engine, label: str, live: LiveBuckets) -> None:
    """Log ("received", server, k) when a server has acknowledged bucket k."""
    push = engine.push_weight_bucket

    async def logged(bucket):
        await push(bucket)
        live.events.append(("received", label, live.index[bucket[0][0]]))
    engine.push_weight_bucket = logged


def received_before_next_but_one(events: list[tuple], servers: list[str], n: int) -> None:
    order = {e: i for i, e in enumerate(events)}
    for k in range(n):
        for s in servers:
            assert ("received", s, k) in order, f"{s} never got bucket {k}"
            if k + 2 < n:
                assert order[("received", s, k)] < order[("produced", k + 2)], f"{s}: bucket {k} after {k + 2} was made"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("stream_models"), "moe")


def _hf(d, name):
    from transformers import AutoModelForCausalLM

    return HFEngine(AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32), max_model_len=256, name=name)


@pytest.mark.slow  # two HTTP rollout servers and a RolloutSide running episodes
def test_push_streams_to_every_server_with_two_buckets_alive_at_most(moe_dir):
    new = perturbed(load_checkpoint(moe_dir), seed=21)
    fmt = ChatFormatter(build_char_tokenizer())
    backends = [_hf(moe_dir, "srv-a"), _hf(moe_dir, "srv-b")]
    local = _hf(moe_dir, "local")
    done = []
    cfg = RolloutSideConfig(batch_size=4, ahead=1, concurrency=4, max_num_seqs=2, sync_timeout_s=60,
                            check_weights=True, check_atol=1e-4, health_interval_s=0)
    clients, runners = [], []

    async def serve_all():
        for e in backends:
            runner, port = await start_server(e)
            runners.append(runner)
            url = f"http://127.0.0.1:{port}"
            clients.append(VLLMServerClient(url, EngineConfig(backend="vllm_server", server_urls=(url,),
                                                              weight_transport="reload")))
    # Servers live on a loop of their own, like separate processes.
    server_loop = asyncio.new_event_loop()
    server_thread = threading.Thread(target=server_loop.run_forever, daemon=True)
    server_thread.start()
    asyncio.run_coroutine_threadsafe(serve_all(), server_loop).result(60)
    engines = [*clients, local]
    labels = [c.url for c in clients] + ["local"]
    side = RolloutSide(engines, lambda t: make_env("toy_tool"), PromptStream(ToyToolTasks(40, seed=1), 0), fmt,
                       AgentLoopConfig(max_turns=2, max_total_tokens=200, max_new_tokens_per_turn=16,
                                       sampling=SamplingParams(max_new_tokens=16)),
                       done.append, cfg, labels=labels)
    live = LiveBuckets(new, per_bucket=3)
    for e, label in zip(engines, labels):
        record_receipts(e, label, live)
    prompt, probe = [5, 6, 7], [9, 10, 11, 12, 13]
    reference = hf_logprobs(moe_dir, new, prompt, probe)
    side.start()
    try:
        while len(done) < 2:  # episodes are running on the servers while the update streams in
            time.sleep(0.05)
        m = side.push_weights(live, 1, check_tokens=prompt + probe, check_prompt_len=3, reference_logprobs=reference)
        metrics = side.metrics()
    finally:
        side.close()

        async def stop():
            for r in runners:
                await r.cleanup()
            for e in backends:
                await e.close()
        asyncio.run_coroutine_threadsafe(stop(), server_loop).result(60)
        server_loop.call_soon_threadsafe(server_loop.stop)
    n = len(live.chunks)
    assert n >= 8 and m.buckets == n and not m.failed
    assert live.max_live_buckets <= 2, f"{live.max_live_buckets} buckets alive at once"
    assert not live.live  # nothing of the update is left behind anywhere
    received_before_next_but_one(live.events, labels, n)
    assert [e.version for e in backends + [local]] == [1, 1, 1]
    assert max(m.logprob_diff.values()) <= 1e-4 and set(m.logprob_diff) == set(labels)
    assert metrics["rollout/version_by_server"] == {label: 1 for label in labels}


class _Consumer:
    """The rollout side as the trainer loop sees it (the boundary): takes buckets one at a time."""

    def __init__(self) -> None:
        self.pushed: list[tuple[int, int]] = []

    def push_weights(self, buckets, version, **kw):
        from megatron_sao.weights.sync import SyncMetrics

        n = sum(1 for _ in buckets)
        self.pushed.append((version, n))
        return SyncMetrics(version, 0.0, 0, 0.0, buckets=n)

    async def update_weights(self, buckets, version):  # the pre-streaming API, for the old loop
        self.pushed.append((version, sum(1 for _ in buckets)))


def _fake_trainer(live: LiveBuckets, policy_lag: int = 0):
    """The trainer's WeightPush on rank 0 of a 1-rank world, with the rollout side as a consumer."""
    from megatron_sao.distributed.gated import GatedCollectives
    from megatron_sao.weights.push import WeightPush

    actor = types.SimpleNamespace(export_hf_weights=lambda nbytes: iter(live))
    push = WeightPush(actor, _Consumer(), GatedCollectives(types.SimpleNamespace(world_size=1)),
                      bucket_bytes=1 << 20, policy_lag=policy_lag, check=False)
    fake = types.SimpleNamespace(rollout=push.rollout, _lagged=push._lagged, version=1)

    def sync():
        return push.push(fake.version, step=7)
    return fake, sync


def test_trainer_sync_weights_never_materializes_the_model(moe_dir):
    """WeightPush.push hands the export generator on; it does not build a list of buckets."""
    live = LiveBuckets(load_checkpoint(moe_dir), per_bucket=2)
    fake, sync = _fake_trainer(live)
    sync()
    assert fake.rollout.pushed == [(1, len(live.chunks))]
    assert live.max_live_buckets <= 2, f"{live.max_live_buckets} of {len(live.chunks)} buckets alive at once"


def test_policy_lag_pushes_explicit_cpu_copies_of_an_older_version(moe_dir):
    state = load_checkpoint(moe_dir)
    live = LiveBuckets(state, per_bucket=4)
    fake, sync = _fake_trainer(live, policy_lag=1)
    sync()  # version 1: kept, nothing pushed yet
    assert fake.rollout.pushed == [] and not live.live  # a copy, not the exported tensors
    (version, snapshot), = fake._lagged
    assert version == 1 and sum(len(b) for b in snapshot) == len(state)
    assert all(t.device.type == "cpu" for b in snapshot for _, t in b)
    fake.version = 2
    sync()  # version 2 kept; version 1 goes to the engines
    assert fake.rollout.pushed == [(1, len(live.chunks))] and [v for v, _ in fake._lagged] == [2]


def test_a_failed_weight_sync_stops_every_rank_without_hanging(moe_dir):
    """A weight sync that fails on rank 0 (a check mismatch, no server left) is broadcast, so every
    rank stops at the same point instead of waiting in the next collective."""
    from megatron_sao.errors import TrainingStopped
    from megatron_sao.weights.sync import WeightSyncError

    live = LiveBuckets(load_checkpoint(moe_dir), per_bucket=4)
    fake, sync = _fake_trainer(live)

    def broken(buckets, version, **kw):
        for _ in buckets:
            pass
        raise WeightSyncError("weight check failed on http://r0:8000 (version 1): max |dlogprob| 0.9 > atol 0.001")
    fake.rollout.push_weights = broken
    with pytest.raises(TrainingStopped, match=r"weight sync v1 failed at step 7: WeightSyncError: weight check failed"):
        sync()
