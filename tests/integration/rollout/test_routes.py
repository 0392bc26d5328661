"""Routes from the rollout engines (routing replay): the HF engine's routers' own choices, stitched by the agent
loop across turns so that every forwarded token is covered exactly once; the server client's base64 decoding."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
import torch

from megatron_sao.models.presets import tiny_hf_config, tiny_hf_model
from megatron_sao.rollout.agent_loop import AgentLoopConfig, run_episode
from megatron_sao.rollout.chat import ChatFormatter
from megatron_sao.rollout.engines.hf_engine import HFEngine
from megatron_sao.rollout.engines.protocol import SamplingParams
from megatron_sao.rollout.engines.routes import decode_b64_routes
from tests.unit.rollout.test_agent_loop_fakes import CountingEnv, qwen_shape_tokenizer, task

TOK = qwen_shape_tokenizer()


def full_forward_routes(model, tokens: list[int]) -> torch.Tensor:
    """[T, layers, topk] of one forward over the whole sequence (the routers' own top-k)."""
    seen = []
    hooks = [m.register_forward_hook(lambda m, a, out: seen.append(out[2]))
             for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    return torch.stack(seen, dim=1)


def same_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.long().sort(dim=-1).values, b.long().sort(dim=-1).values)


@pytest.fixture(scope="module")
def moe():
    return tiny_hf_model(tiny_hf_config("qwen3_moe", vocab_size=len(TOK)), seed=0)


def test_hf_engine_returns_what_its_routers_chose(moe):
    """Batched decoding of three requests: each one's routes (prompt from routes_start, every sampled token but
    the last) are the routes of a full forward over its final sequence, in uint8 for 4 experts."""
    prompts = [[1, 5, 7, 9, 11], [3, 4], [8, 8, 8, 2, 6, 7]]

    async def run():
        e = HFEngine(moe, max_model_len=64, max_batch_size=4)
        try:
            return await asyncio.gather(*[e.generate(p, SamplingParams(max_new_tokens=6, seed=i, return_routes=True,
                                                                       routes_start=1))
                                          for i, p in enumerate(prompts)])
        finally:
            await e.close()

    for p, r in zip(prompts, asyncio.run(run())):
        assert r.routed_experts.dtype == torch.uint8
        assert r.routed_experts.shape == (len(p) - 1 + len(r.token_ids) - 1, 2, 2)
        assert same_sets(r.routed_experts, full_forward_routes(moe, p + r.token_ids)[1:-1])


def test_hf_engine_refuses_routes_of_a_dense_model():
    dense = tiny_hf_model(tiny_hf_config("qwen3"), seed=0)

    async def run():
        e = HFEngine(dense, max_model_len=32)
        try:
            await e.generate([1, 2, 3], SamplingParams(max_new_tokens=2, return_routes=True))
        finally:
            await e.close()

    with pytest.raises(ValueError, match="return_routes needs a transformers MoE model"):
        asyncio.run(run())


def test_multi_turn_routes_cover_every_forwarded_token_exactly_once(moe):
    """Three turns with observations between them: each turn re-prefills the history but returns routes only
    from where the last turn's ended, so the stitched routes equal one forward over the whole trajectory
    for tokens 0..T-2 (the final token is never forwarded)."""
    cfg = AgentLoopConfig(max_turns=5, max_total_tokens=200, max_new_tokens_per_turn=6,
                          sampling=SamplingParams(max_new_tokens=6, seed=11), return_routes=True)

    async def run():
        e = HFEngine(moe, max_model_len=256)
        try:
            return await run_episode(e, CountingEnv(done_after=3), task(), ChatFormatter(TOK), cfg)
        finally:
            await e.close()

    traj = asyncio.run(run())
    assert traj.status == "terminated" and traj.num_turns == 3, traj.error
    routes = traj.routed_experts
    assert routes.shape == (traj.length - 1, 2, 2) and routes.dtype == torch.uint8
    assert same_sets(routes, full_forward_routes(moe, traj.tokens.tolist())[:-1])


def test_server_routes_decode_from_base64_npy():
    array = np.array([[[0, 3], [2, 1]], [[1, 2], [3, 0]]], dtype=np.int32)  # what vLLM's numpy2base64 sends
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    t = decode_b64_routes(base64.b64encode(buf.getvalue()).decode(), 4, "test")
    assert t.dtype == torch.uint8 and t.tolist() == array.tolist()
    with pytest.raises(RuntimeError, match="outside 0..2"):
        decode_b64_routes(base64.b64encode(buf.getvalue()).decode(), 3, "test")
    with pytest.raises(RuntimeError, match="none came back"):
        decode_b64_routes(None, 4, "test")
    with pytest.raises(RuntimeError, match="not a base64 .npy"):
        decode_b64_routes(base64.b64encode(b"junk").decode(), 4, "test")


def test_colocated_routes_pack_comparably_and_unpack_exactly():
    from megatron_sao.rollout.engines.routes import packed_routes, unpacked_routes

    array = np.array([[[0, 3], [2, 1]], [[1, 2], [3, 0]]], dtype=np.int64)
    a, b = packed_routes(array, 4, "e0"), packed_routes(array.copy(), 4, "e0")
    assert a == b and a != packed_routes(array[:1], 4, "e0")  # what the leader's lockstep check compares
    t = unpacked_routes(a)
    assert t.dtype == torch.uint8 and t.tolist() == array.tolist()
    assert unpacked_routes(None) is None


@pytest.mark.parametrize("route", ["generate", "completions"])
def test_server_client_gets_the_routes_of_a_served_engine(tmp_path, route):
    """VLLMServerClient -> rollout/engines/http_server.py (vLLM's routes, an HF engine behind them): the client
    sends routed_experts_prompt_start and decodes the base64 routes, on both of vLLM's generation routes."""
    pytest.importorskip("aiohttp")
    from transformers import AutoModelForCausalLM

    from megatron_sao.rollout.engines.factory import make_engine
    from megatron_sao.rollout.engines.http_server import start_server
    from megatron_sao.rollout.engines.protocol import EngineConfig
    from tests.engine_fixtures import make_tiny_model

    model_dir = make_tiny_model(tmp_path, "moe")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    prompt = [5, 6, 7, 8]

    async def run():
        engine = HFEngine(model, max_model_len=128, eos_token_ids=())
        runner, port = await start_server(engine)
        client = make_engine(EngineConfig(backend="vllm_server", server_urls=(f"http://127.0.0.1:{port}",),
                                          model_path=str(model_dir), weight_transport="reload"))
        try:
            await client.connect()
            client.route = route
            return await client.generate(prompt, SamplingParams(max_new_tokens=5, seed=3, return_routes=True,
                                                                routes_start=2))
        finally:
            await client.close()
            await runner.cleanup()
            await engine.close()

    out = asyncio.run(run())
    assert out.routed_experts.dtype == torch.uint8 and out.routed_experts.shape == (2 + 5 - 1, 2, 2)
    assert same_sets(out.routed_experts, full_forward_routes(model, prompt + out.token_ids)[2:-1])


def test_scored_routes_must_cover_every_token_of_the_scored_prompt():
    from megatron_sao.rollout.engines.routes import scored_routes

    routes = torch.zeros(5, 2, 2, dtype=torch.uint8)
    assert scored_routes(routes, 5, "srv") is routes
    with pytest.raises(KeyError, match="srv: routed_experts of a scored prompt cover 5 tokens, expected 6"):
        scored_routes(routes, 6, "srv", KeyError)
