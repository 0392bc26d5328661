"""One transfer group for every rollout server: rank 0 broadcasts each bucket once, whatever the number
of servers; a server that dies mid-bucket is dropped without hanging the others, who still load every
tensor exactly once; the group is formed once, reused, and re-formed when the servers change.

The servers' workers are our vLLM transfer engine (`vllm_worker/gloo_engine.py`, what `vllm serve`
runs on CPU) in threads of this process, driven through the calls the HTTP routes make
(`init_transfer_engine`, `update_weights`); the group, the rendezvous and gloo are real. What a real
`vllm serve` adds (HTTP, the layerwise reload) is covered by test_weight_sync_vllm_servers.py beside this file.
"""

from __future__ import annotations

import asyncio
import time
import types

import pytest
import torch

pytest.importorskip("vllm")

from megatron_sao.distributed.ports import free_port
from megatron_sao.weights.server_group import ServerTransferGroup, member_init_info, rank_offsets

pytestmark = pytest.mark.timeout(300)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.loads: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights):
        self.loads.extend((n, t.clone()) for n, t in weights)


class ThreadServer:
    """One server's TP workers as gloo transfer engines in threads (the boundary: no HTTP, no vLLM model)."""

    def __init__(self, name: str, tp: int = 1) -> None:
        from vllm.config.parallel import ParallelConfig

        from megatron_sao.weights.vllm_worker import gloo_engine

        cls = gloo_engine._engine_class()
        self.name, self.transfer_world_size = name, tp
        self.engines = []
        for r in range(tp):
            pc = ParallelConfig(tensor_parallel_size=tp)
            pc.rank = r
            self.engines.append(cls(None, types.SimpleNamespace(parallel_config=pc, model_config=None),
                                    torch.device("cpu"), Model()))
        self.dead = False
        self.die_on_receive = False  # the process dies as the next bucket starts (its connections close)
        self.refuse_once_after_s: float | None = None  # the next receive is refused after this delay
        self.inits: list[dict] = []
        self.reopened = 0  # updates reopened for a second try (a receive failed)

    def start_update(self) -> None:  # what start_weight_update resets (without vLLM's layerwise reload)
        for e in self.engines:
            e.received, e._loaded = [], set()

    async def join_transfer_group(self, init_info: dict) -> None:
        if self.dead:
            raise ConnectionError(f"{self.name} is dead")
        self.inits.append(init_info)
        await asyncio.gather(*(asyncio.to_thread(e.init_transfer_engine, e.parse_init_info(init_info))
                               for e in self.engines))

    async def receive_bucket(self, update_info: dict) -> None:
        if self.die_on_receive:
            self.dead, self.die_on_receive = True, False
            for e in self.engines:
                e.shutdown()
            raise ConnectionError(f"{self.name} died")
        if self.dead:
            raise ConnectionError(f"{self.name} is dead")
        if self.refuse_once_after_s is not None:
            delay, self.refuse_once_after_s = self.refuse_once_after_s, None
            await asyncio.sleep(delay)
            raise RuntimeError(f"{self.name} refused the bucket")
        await asyncio.gather(*(asyncio.to_thread(e.update_weights, update_info) for e in self.engines))

    async def reopen_update(self) -> None:  # vLLM's worker session is not modelled here
        if self.dead:
            raise ConnectionError(f"{self.name} is dead")
        self.reopened += 1

    async def health(self) -> bool:
        return not self.dead

    def loaded(self) -> list[list[str]]:
        return [[n for n, _ in e.model.loads] for e in self.engines]


def buckets(k: int = 3) -> list[list]:
    g = torch.Generator().manual_seed(0)
    return [[(f"w{b}.{j}", torch.randn(5, 3, generator=g)) for j in range(2)] + [(f"i{b}", torch.tensor([b]))]
            for b in range(k)]


def run_update(group, servers, bs) -> dict:
    async def go():
        for s in servers:
            s.start_update()
        dropped = await group.ensure(servers)
        retry = set(servers)
        for b in bs:
            dropped.update(await group.send_bucket(b, retry))
        return dropped
    return asyncio.run(go())


def test_rank_offsets_follow_each_servers_tp():
    assert rank_offsets([1, 1, 1]) == [1, 2, 3]
    assert rank_offsets([2, 4, 1]) == [1, 3, 7]
    assert member_init_info("h", 5, 3, 8) == {"master_address": "h", "master_port": 5, "rank_offset": 3,
                                              "world_size": 8, "packed": False}
    with pytest.raises(ValueError, match=">= 1"):
        rank_offsets([1, 0])


def test_one_broadcast_per_bucket_for_every_server_and_the_group_is_reused():
    servers = [ThreadServer("a"), ThreadServer("b", tp=2), ThreadServer("c")]
    group = ServerTransferGroup("127.0.0.1", [free_port(), free_port()], "gloo", timeout_s=60)
    bs = buckets()
    try:
        assert run_update(group, servers, bs) == {}
        assert run_update(group, servers, bs) == {}  # the second update reuses the group
    finally:
        group.close()
    # gloo: one broadcast per bucket (packed), not one per server or per tensor
    assert group.packed and group.broadcasts == group.bucket_sends == 2 * len(bs)
    assert group.formations == 1
    assert [i["rank_offset"] for s in servers for i in s.inits] == [1, 2, 4]  # b's two workers at 2, 3
    assert {i["world_size"] for s in servers for i in s.inits} == {5}
    names = [n for b in bs for n, _ in b]
    for s in servers:
        for e in s.engines:
            assert [n for n, _ in e.model.loads] == names * 2  # every tensor, once per update
            assert all(torch.equal(t, dict(x for b in bs for x in b)[n]) for n, t in e.model.loads)


def test_a_server_that_dies_mid_update_is_dropped_and_the_others_load_every_tensor_once():
    servers = [ThreadServer("a"), ThreadServer("b"), ThreadServer("c")]
    group = ServerTransferGroup("127.0.0.1", [free_port(), free_port(), free_port()], "gloo", timeout_s=30)
    bs = buckets(4)
    names = [n for b in bs for n, _ in b]
    try:
        assert run_update(group, servers, bs) == {}

        async def killed_at_bucket_2():
            for s in servers:
                s.start_update()
            await group.ensure(servers)
            retry, dropped = set(servers), {}
            for k, b in enumerate(bs):
                if k == 2:
                    servers[1].die_on_receive = True
                dropped.update(await group.send_bucket(b, retry))
            return dropped
        dropped = asyncio.run(killed_at_bucket_2())
        assert list(dropped) == [servers[1]] and "died" in dropped[servers[1]]
        assert group.members == (servers[0], servers[2])  # re-formed without it, mid-update
        for s in (servers[0], servers[2]):
            assert s.loaded() == [names * 2]  # both updates whole, no tensor loaded twice
        assert servers[1].loaded() == [names + names[:6]]  # the dead one stopped after two buckets

        # The next update reuses the survivors' group; the restarted server joins at the one after.
        formations = group.formations
        assert run_update(group, [servers[0], servers[2]], bs) == {}
        assert group.formations == formations
        servers[1].dead = False
        assert run_update(group, servers, bs) == {}
        assert group.formations == formations + 1 and group.members == tuple(servers)
    finally:
        group.close()
    assert servers[0].loaded() == [names * 4] and servers[1].loaded()[0][-len(names):] == names


def test_the_broadcast_waits_for_every_receiver_and_a_late_refusal_hangs_nothing():
    """Rank 0 broadcasts a bucket when every worker said it receives it: a receive refused after a
    moment (here 0.5 s, longer than any fixed wait would be) fails that member at once instead of
    leaving a broadcast too large for the socket buffers blocked on it until the timeout; the member,
    still healthy, gets the bucket again over a re-formed group."""
    servers = [ThreadServer("a"), ThreadServer("b", tp=2)]
    group = ServerTransferGroup("127.0.0.1", [free_port(), free_port()], "gloo", timeout_s=60)
    big = [[("big", torch.arange(4 << 20, dtype=torch.float32))], *buckets(1)]  # 16 MiB: beyond a socket buffer
    names = [n for b in big for n, _ in b]
    try:
        assert run_update(group, servers, big) == {}
        servers[1].refuse_once_after_s = 0.5
        t0 = time.monotonic()
        assert run_update(group, servers, big) == {}
        elapsed = time.monotonic() - t0
    finally:
        group.close()
    assert elapsed < 30, elapsed  # not the 60 s timeout of a broadcast to a worker that never receives
    assert group.formations == 2  # re-formed once, for the refused member's second try
    assert [s.reopened for s in servers] == [1, 1]  # the group broke for both: both sessions reopened
    for s in servers:
        assert s.loaded() == [names * 2] * s.transfer_world_size  # every tensor, once per update
    assert torch.equal(dict(servers[1].engines[1].model.loads)["big"], big[0][0][1])


def test_a_server_that_cannot_join_is_left_out_and_the_group_forms_over_the_rest():
    servers = [ThreadServer("a"), ThreadServer("b")]
    servers[0].dead = True
    group = ServerTransferGroup("127.0.0.1", [free_port(), free_port()], "gloo", timeout_s=10)
    try:
        dropped = run_update(group, servers, buckets(1))
    finally:
        group.close()
    assert list(dropped) == [servers[0]] and "health" in dropped[servers[0]]
    assert group.formations == 1  # no rendezvous was tried with it
    assert servers[1].loaded() == [[n for n, _ in buckets(1)[0]]]


def test_a_packed_bucket_unpacks_to_the_same_tensors():
    from megatron_sao.weights.vllm_worker.transfer_group import pack_bucket, unpack_bucket

    ts = [torch.randn(3, 4), torch.tensor(7, dtype=torch.int64), torch.randn(5).to(torch.bfloat16), torch.ones(0, 2)]
    flat = pack_bucket(ts)
    assert flat.dtype == torch.uint8 and flat.numel() == 48 + 16 + 16 + 0  # each tensor 16-byte aligned
    back = unpack_bucket(flat, [t.dtype for t in ts], [list(t.shape) for t in ts])
    assert all(b.dtype == t.dtype and torch.equal(b, t) for b, t in zip(back, ts))
    with pytest.raises(ValueError, match="bytes"):
        unpack_bucket(flat, [torch.float32], [[3, 4]])
