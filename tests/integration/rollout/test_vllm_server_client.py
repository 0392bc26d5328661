"""VLLMServerClient against rollout/engines/http_server.py serving an HFEngine (same routes as `vllm serve`)."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch

from tests.engine_fixtures import hf_logprobs, load_checkpoint, make_tiny_model, perturbed

pytest.importorskip("aiohttp")

from megatron_sao.rollout.engines.factory import make_engine
from megatron_sao.rollout.engines.hf_engine import HFEngine
from megatron_sao.rollout.engines.http_server import start_server
from megatron_sao.rollout.engines.protocol import EngineConfig, SamplingParams
from megatron_sao.rollout.engines.vllm_server_client import ServerError, VLLMServerClient
from megatron_sao.weights.sync import WeightSync

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("srv_models"), "moe")


def _client_cfg(url: str, policy: str = "keep", **kw) -> EngineConfig:
    return EngineConfig(backend="vllm_server", server_urls=(url,), inflight_policy=policy,
                        weight_transport="reload", **kw)


async def _serve(model_dir, policy: str = "keep"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    engine = HFEngine(model, max_model_len=256, inflight_policy=policy, eos_token_ids=())
    runner, port = await start_server(engine)
    client = make_engine(_client_cfg(f"http://127.0.0.1:{port}", policy))
    assert isinstance(client, VLLMServerClient)
    return engine, runner, client


def test_generate_update_and_check_over_http(model_dir):
    new = perturbed(load_checkpoint(model_dir), seed=8)

    async def run():
        engine, runner, client = await _serve(model_dir)
        try:
            assert await client.health()
            outs = await asyncio.gather(*(client.generate([5, 6, 7 + i], SamplingParams(max_new_tokens=8, seed=i))
                                          for i in range(3)))
            metrics = await WeightSync([client], timeout_s=60).push([list(new.items())], version=2)
            after = await client.generate([5, 6, 7], SamplingParams(max_new_tokens=8, seed=0, temperature=0.7))
            tokens = [5, 6, 7] + after.token_ids
            score = await client.score(tokens, 3)
            return outs, metrics, after, score, engine.version, client.version
        finally:
            await client.close()
            await runner.cleanup()
            await engine.close()

    outs, metrics, after, score, server_version, client_version = asyncio.run(run())
    for i, out in enumerate(outs):
        ref = hf_logprobs(model_dir, None, [5, 6, 7 + i], out.token_ids)
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref)) <= 1e-4 and out.versions == [0] * 8
    assert server_version == client_version == 2 and metrics.bytes > 0
    assert after.versions == [2] * 8 and after.finish_reason == "length"
    ref_t = hf_logprobs(model_dir, new, [5, 6, 7], after.token_ids, temperature=0.7)
    assert max(abs(a - b) for a, b in zip(after.logprobs, ref_t)) <= 1e-4
    ref_score = hf_logprobs(model_dir, new, [5, 6, 7], after.token_ids)
    assert max(abs(a - b) for a, b in zip(score, ref_score)) <= 1e-4


def test_server_spans_keep_versions_and_rejects_bad_input(model_dir):
    new = perturbed(load_checkpoint(model_dir), seed=9)

    async def run():
        engine, runner, client = await _serve(model_dir)
        try:
            await client.pause()
            task = asyncio.ensure_future(client.generate([5, 6], SamplingParams(max_new_tokens=6, seed=1)))
            await asyncio.sleep(0.3)
            waiting = not task.done()
            # an update while the server is paused: the queued request then runs under version 1
            await engine.update_weights([list(new.items())], 1)
            await client.resume()
            out = await task
            with pytest.raises(ServerError, match=r"sao/update_weights -> HTTP 400.*unknown weight name"):
                await client.update_weights([[("model.nope.weight", torch.zeros(2))]], 3)
            with pytest.raises(ServerError, match=r"/v1/completions -> HTTP 400.*echo"):
                await client._request("POST", "/v1/completions", json={"prompt": [1, 2], "echo": True}, timeout_s=5)
            return waiting, out, client.version
        finally:
            await client.close()
            await runner.cleanup()
            await engine.close()

    waiting, out, version = asyncio.run(run())
    assert waiting and out.versions == [1] * 6  # spans come from the server, not the client's counter
    assert version == 0  # the rejected update did not move the client's version


def test_unreachable_server_error_names_the_url():
    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"

    async def run():
        client = VLLMServerClient(url, _client_cfg(url, control_timeout_s=2.0, request_timeout_s=2.0))
        try:
            healthy = await client.health()
            with pytest.raises(ServerError, match=rf"GET {url}/sao/info failed"):
                await client.generate([1, 2], SamplingParams(max_new_tokens=2))
            return healthy
        finally:
            await client.close()

    assert asyncio.run(run()) is False
    with pytest.raises(ValueError, match="http"):
        VLLMServerClient("localhost:8000", _client_cfg("http://x"))


def test_make_engines_builds_one_client_per_server():
    from megatron_sao.rollout.engines.factory import make_engines

    clients = make_engines(EngineConfig(backend="vllm_server", server_urls=("http://h1:8000", "http://h2:8000/")))
    assert [c.url for c in clients] == ["http://h1:8000", "http://h2:8000"]


def test_serve_rollout_cli_refuses_a_non_hf_model_path():
    import argparse

    from megatron_sao.trainer.serve_rollout import main

    args = argparse.Namespace(config=None, overrides=["model.path=/nonexistent"], host="127.0.0.1", port=0)
    with pytest.raises(SystemExit, match="neither a built-in model"):
        main(args)


def test_a_request_spanning_an_update_carries_both_versions(model_dir):
    """inflight_policy keep through the client: the server labels each token with the weights that
    sampled it (weight_versions spans of /inference/v1/generate), so DIS divides by the right ones."""
    new = perturbed(load_checkpoint(model_dir), seed=11)

    async def run():
        engine, runner, client = await _serve(model_dir)
        try:
            await client.connect()
            assert client.route == "generate" and client.transport == "reload" and client.kind == "sao"
            task = asyncio.ensure_future(client.generate([5, 6, 7], SamplingParams(max_new_tokens=40, seed=3)))
            while not (engine._active and len(engine._active[0].token_ids) >= 5):
                await asyncio.sleep(0.001)
            await engine.pause()  # freeze it mid-request, then update under it
            await client.update_weights(_halves(new), 1)
            await engine.resume()
            return await task, client.version
        finally:
            await client.close()
            await runner.cleanup()
            await engine.close()

    out, version = asyncio.run(run())
    k = out.versions.index(1)
    assert version == 1 and k >= 5 and out.versions == [0] * k + [1] * (40 - k)


def _halves(state):
    names = list(state)
    yield [(n, state[n]) for n in names[: len(names) // 2]]
    yield [(n, state[n]) for n in names[len(names) // 2:]]


def test_expand_spans_names_a_bad_label():
    from megatron_sao.rollout.engines.vllm_server_client import expand_spans

    assert expand_spans([{"version": "2", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 3}], 3, "x") == \
        [2, 2, 3]
    with pytest.raises(ServerError, match="'default' is not an int"):
        expand_spans([{"version": "default", "start": 0, "end": 1}], 1, "x")
    with pytest.raises(ServerError, match="do not cover"):
        expand_spans([{"version": "1", "start": 0, "end": 1}], 2, "x")


class _VLLMSessionRules:
    """The control plane of a `vllm serve` worker's weight-update session, as vLLM 0.32 enforces it
    (gpu_worker.py): start while a session is active, or finish without one, is an error; one bucket's
    receive fails as a worker error would. Only what these routes need; the data plane is not here."""

    def __init__(self) -> None:
        self.active = False
        self.calls: list[tuple[str, object]] = []
        self.fail_next_update = False

    def app(self):
        from aiohttp import web

        async def route(request: web.Request) -> web.Response:
            body = await request.json() if request.can_read_body else None
            self.calls.append((request.path, body))
            if request.path == "/start_weight_update":
                if self.active:
                    return web.json_response({"error": "start_weight_update called while a weight update is "
                                                       "already active. Call finish_weight_update first."}, status=500)
                self.active = True
            elif request.path == "/update_weights" and self.fail_next_update:
                self.fail_next_update = False
                return web.json_response({"error": "receive failed"}, status=500)
            elif request.path == "/finish_weight_update":
                if not self.active:
                    return web.json_response({"error": "finish_weight_update called without a matching "
                                                       "start_weight_update."}, status=500)
                self.active = False
            return web.json_response({"ok": True})

        app = web.Application()
        for path in ("/pause", "/resume", "/start_weight_update", "/update_weights", "/finish_weight_update"):
            app.router.add_post(path, route)
        return app


class _NoDataPlane:
    """Stands in for the transfer group: this test is about the HTTP session, not the broadcast."""

    def __init__(self, member) -> None:
        self.member = member

    async def ensure(self, members):
        return {}

    def new_update(self):
        pass

    async def send_bucket(self, bucket, retry=None):
        from megatron_sao.weights.buckets import bucket_update_info

        try:
            await self.member.receive_bucket(bucket_update_info(bucket))
        except ServerError as e:
            return {self.member: str(e)}
        return {}

    def close(self):
        pass


def test_an_aborted_vllm_update_leaves_the_session_so_the_server_can_take_the_next_one():
    """Before: abort only resumed, the workers' update session stayed open, and every later update
    (a rejoin on probation included) was refused with 'already active'."""
    from aiohttp import web

    rules = _VLLMSessionRules()
    bucket = [("model.norm.weight", torch.ones(4))]

    async def run():
        runner = web.AppRunner(rules.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        client = VLLMServerClient(url, EngineConfig(backend="vllm_server", server_urls=(url,), weight_transport="gloo",
                                                    control_timeout_s=5.0))
        client.kind, client.transport, client.route = "vllm", "gloo", "generate"
        client._solo = _NoDataPlane(client)
        try:
            await client.begin_weight_update(1)
            rules.fail_next_update = True
            with pytest.raises(ServerError, match="update_weights"):
                await client.push_weight_bucket(bucket)
            await client.abort_weight_update()
            aborted = list(rules.calls)
            rules.calls.clear()
            await client.update_weights([bucket], 2)  # the next complete update goes through
            return aborted, client.version
        finally:
            await client.close()
            await runner.cleanup()

    aborted, version = asyncio.run(run())
    assert [p for p, _ in aborted] == ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update",
                                       "/resume"]
    assert aborted[3][1] == {}  # no weight_version: the label stays the old one
    assert version == 2 and [p for p, _ in rules.calls] == ["/pause", "/start_weight_update", "/update_weights",
                                                             "/finish_weight_update", "/resume"]
    assert rules.calls[3][1] == {"weight_version": "2"} and not rules.active


def test_routes_from_a_dense_model_path_fail_with_the_same_clear_error_every_time(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # no expert count
    url = "http://127.0.0.1:1"
    client = VLLMServerClient(url, _client_cfg(url, model_path=str(tmp_path)))
    for _ in range(2):  # a failed lookup is not cached as "0 experts" (which read as "experts outside 0..-1")
        with pytest.raises(ServerError, match="Mixture-of-Experts model"):
            client._routes({"routed_experts": "AAAA"}, "test")
