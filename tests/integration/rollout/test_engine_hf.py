"""HFEngine: log-prob semantics, batching, weight updates (MoE fused experts), keep/abort policies."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_sao.rollout.engines.factory import make_engine
from megatron_sao.rollout.engines.hf_engine import HFEngine
from megatron_sao.rollout.engines.protocol import EngineConfig, GenerationResult, SamplingParams
from megatron_sao.rollout.engines.sampling import processed_logprobs
from tests.engine_fixtures import EOS_ID, hf_logprobs, load_checkpoint, make_tiny_model, perturbed

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_models")
    return {kind: make_tiny_model(root, kind) for kind in ("dense", "moe")}


def _engine(model_dir, **kw) -> HFEngine:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    kw.setdefault("max_model_len", 256)
    return HFEngine(model, **kw)


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) for x, y in zip(a, b))


async def _wait_tokens(engine: HFEngine, n: int) -> None:
    """Wait until the (single) active request has at least n tokens, then pause the engine."""
    for _ in range(2000):
        if engine._active and len(engine._active[0].token_ids) >= n:
            await engine.pause()
            return
        await asyncio.sleep(0.005)
    raise AssertionError("request never reached the expected length")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_batched_logprobs_match_transformers_forward(model_dirs, kind):
    async def run():
        engine = make_engine(EngineConfig(backend="hf", model_path=str(model_dirs[kind]), max_model_len=256))
        prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20]]  # different lengths -> padded batch cache
        outs = await asyncio.gather(
            *(engine.generate(p, SamplingParams(max_new_tokens=12, seed=i)) for i, p in enumerate(prompts))
        )
        await engine.close()
        return prompts, outs

    prompts, outs = asyncio.run(run())
    for p, out in zip(prompts, outs):
        assert isinstance(out, GenerationResult)
        assert out.versions == [0] * len(out.token_ids)
        assert out.finish_reason == ("stop" if out.token_ids[-1] == EOS_ID else "length")
        assert _max_diff(out.logprobs, hf_logprobs(model_dirs[kind], None, p, out.token_ids)) <= 1e-4


def test_same_seed_same_tokens_regardless_of_batch(model_dirs):
    async def run():
        engine = _engine(model_dirs["dense"])
        alone = await engine.generate([5, 6, 7], SamplingParams(max_new_tokens=10, seed=42))
        together = await asyncio.gather(
            engine.generate([5, 6, 7], SamplingParams(max_new_tokens=10, seed=42)),
            engine.generate([9, 9], SamplingParams(max_new_tokens=10, seed=1)),
        )
        await engine.close()
        return alone, together[0]

    alone, batched = asyncio.run(run())
    assert alone.token_ids == batched.token_ids
    assert _max_diff(alone.logprobs, batched.logprobs) <= 1e-5


def test_processed_logprobs_with_temperature_and_top_k(model_dirs):
    d = model_dirs["dense"]
    prompt = [5, 6, 7]

    async def run(sampling):
        engine = _engine(d, eos_token_ids=())
        out = await engine.generate(prompt, sampling)
        await engine.close()
        return out

    hot = asyncio.run(run(SamplingParams(max_new_tokens=10, temperature=0.6, seed=3)))
    assert _max_diff(hot.logprobs, hf_logprobs(d, None, prompt, hot.token_ids, temperature=0.6)) <= 1e-4
    # raw (T=1) log-probs would differ: the recorded values are not the unprocessed ones
    assert _max_diff(hot.logprobs, hf_logprobs(d, None, prompt, hot.token_ids)) > 1e-2

    topk = asyncio.run(run(SamplingParams(max_new_tokens=10, top_k=5, seed=3)))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + topk.token_ids])).logits[0, len(prompt) - 1 : -1]
    for j, t in enumerate(topk.token_ids):
        assert t in torch.topk(logits[j], 5).indices.tolist()  # sampled inside the top-5
        ref = torch.log_softmax(torch.topk(logits[j], 5).values, -1)[torch.topk(logits[j], 5).indices == t]
        assert abs(topk.logprobs[j] - float(ref)) <= 1e-4


def test_top_p_keeps_the_nucleus():
    logits = torch.tensor([3.0, 2.0, 1.0, -5.0])
    lp = processed_logprobs(logits, SamplingParams(max_new_tokens=1, top_p=0.8))
    probs = torch.softmax(logits, -1)  # [0.665, 0.245, 0.090, ~0]
    assert torch.isinf(lp[2]) and torch.isinf(lp[3])  # mass before token 2 is 0.91 >= 0.8
    assert torch.allclose(lp[:2].exp(), probs[:2] / probs[:2].sum())


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_update_weights_by_checkpoint_names(model_dirs, kind):
    d = model_dirs[kind]
    new = perturbed(load_checkpoint(d), seed=11)
    names = list(new)
    if kind == "moe":  # the update really uses per-expert on-disk names
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in names

    async def run():
        engine = _engine(d)
        buckets = [[(n, new[n]) for n in names[i : i + 7]] for i in range(0, len(names), 7)]
        await engine.update_weights(iter(buckets), version=5)
        out = await engine.generate([5, 6, 7], SamplingParams(max_new_tokens=12, seed=0))
        score = await engine.score([5, 6, 7] + out.token_ids, 3)
        await engine.close()
        return engine, out, score

    engine, out, score = asyncio.run(run())
    assert engine.version == 5 and out.versions == [5] * len(out.token_ids)
    ref_new = hf_logprobs(d, new, [5, 6, 7], out.token_ids)
    assert _max_diff(out.logprobs, ref_new) <= 1e-4
    assert _max_diff(score, ref_new) <= 1e-4
    assert _max_diff(out.logprobs, hf_logprobs(d, None, [5, 6, 7], out.token_ids)) > 1e-2


def test_bad_updates_raise_and_change_nothing(model_dirs):
    d = model_dirs["moe"]
    state = load_checkpoint(d)
    new = perturbed(state, seed=2)

    async def run():
        engine = _engine(d)
        before = {k: v.clone() for k, v in engine.model.state_dict().items()}
        good = list(new.items())
        with pytest.raises(KeyError, match="unknown weight name.*model.layers.0.mlp.experts.9.gate_proj.weight"):
            await engine.update_weights(
                [good, [("model.layers.0.mlp.experts.9.gate_proj.weight", torch.zeros(32, 64))]], 1)
        with pytest.raises(ValueError, match="model.norm.weight.*shape"):
            await engine.update_weights([good[:-1] + [("model.norm.weight", torch.zeros(3))]], 1)
        with pytest.raises(ValueError, match="twice"):
            await engine.update_weights([good, good[:1]], 1)
        after = {k: v.clone() for k, v in engine.model.state_dict().items()}
        version_after_failures = engine.version
        with pytest.raises(RuntimeError, match="outside begin/finish"):
            await engine.push_weight_bucket(good)
        await engine.update_weights([good[:3], good[3:]], 4)  # a failed stream leaves nothing behind
        await engine.close()
        return engine, before, after, version_after_failures

    engine, before, after, version_after_failures = asyncio.run(run())
    assert version_after_failures == 0 and engine.version == 4
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_keep_policy_versions_span_the_update(model_dirs):
    d = model_dirs["dense"]
    new = perturbed(load_checkpoint(d), seed=4)

    async def run():
        engine = _engine(d, inflight_policy="keep", eos_token_ids=())
        task = asyncio.create_task(engine.generate([5, 6, 7], SamplingParams(max_new_tokens=40, seed=0)))
        await _wait_tokens(engine, 3)
        await engine.update_weights([list(new.items())], version=1)
        await engine.resume()
        out = await task
        await engine.close()
        return out

    out = asyncio.run(run())
    assert out.finish_reason == "length" and len(out.token_ids) == 40
    k = out.versions.index(1)
    assert k >= 3 and out.versions == [0] * k + [1] * (40 - k)
    # tokens sampled before the update carry old-weight log-probs
    assert _max_diff(out.logprobs[:k], hf_logprobs(d, None, [5, 6, 7], out.token_ids[:k])) <= 1e-4


def test_abort_policy_returns_partial_tokens(model_dirs):
    d = model_dirs["dense"]
    new = perturbed(load_checkpoint(d), seed=4)

    async def run():
        engine = _engine(d, inflight_policy="abort", eos_token_ids=())
        task = asyncio.create_task(engine.generate([5, 6, 7], SamplingParams(max_new_tokens=40, seed=0)))
        await _wait_tokens(engine, 3)
        await engine.update_weights([list(new.items())], version=1)
        aborted = await task
        await engine.resume()
        fresh = await engine.generate([5, 6, 7], SamplingParams(max_new_tokens=5, seed=0))
        await engine.close()
        return aborted, fresh

    aborted, fresh = asyncio.run(run())
    assert aborted.finish_reason == "abort"
    assert 3 <= len(aborted.token_ids) < 40 and aborted.versions == [0] * len(aborted.token_ids)
    assert fresh.versions == [1] * 5


def test_requests_wait_while_paused_and_cancel_is_safe(model_dirs):
    async def run():
        engine = _engine(model_dirs["dense"], eos_token_ids=())
        await engine.pause()
        task = asyncio.create_task(engine.generate([5], SamplingParams(max_new_tokens=4, seed=0)))
        doomed = asyncio.create_task(engine.generate([6], SamplingParams(max_new_tokens=4, seed=0)))
        await asyncio.sleep(0.2)
        still_waiting = not task.done()
        doomed.cancel()
        await engine.resume()
        out = await task
        healthy = await engine.health()
        await engine.close()
        closed_healthy = await engine.health()
        return still_waiting, out, healthy, closed_healthy, doomed

    still_waiting, out, healthy, closed_healthy, doomed = asyncio.run(run())
    assert still_waiting and len(out.token_ids) == 4 and doomed.cancelled()
    assert healthy and not closed_healthy


def test_request_cancelled_while_another_is_prefilled_does_not_fail_the_batch(model_dirs):
    """Regression (CI flake): a request admitted with others and cancelled before its own prefill ran
    used to stay in the decode batch without logits, failing every request in that batch."""

    async def run():
        engine = _engine(model_dirs["dense"], eos_token_ids=())
        inner_forward = engine.model.forward
        first_prefill_started = asyncio.Event()
        loop = asyncio.get_running_loop()
        calls = {"n": 0}

        def slow_forward(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 1:  # the first admitted request's prefill: let the test cancel the second now
                loop.call_soon_threadsafe(first_prefill_started.set)
                import time

                time.sleep(0.5)
            return inner_forward(*args, **kwargs)

        engine.model.forward = slow_forward
        await engine.pause()
        task = asyncio.create_task(engine.generate([5], SamplingParams(max_new_tokens=4, seed=0)))
        doomed = asyncio.create_task(engine.generate([6], SamplingParams(max_new_tokens=4, seed=0)))
        await asyncio.sleep(0.05)
        await engine.resume()
        await first_prefill_started.wait()
        doomed.cancel()
        out = await task
        await engine.close()
        return out, doomed

    out, doomed = asyncio.run(run())
    assert len(out.token_ids) == 4 and doomed.cancelled()


def test_plain_module_without_kv_cache(model_dirs):
    """A non-transformers module (e.g. a wrapped Megatron model) returning a logits tensor works."""
    from transformers import AutoModelForCausalLM

    d = model_dirs["dense"]
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = hf

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.inner(input_ids).logits

    async def run():
        engine = HFEngine(Wrapped(), max_model_len=64)
        assert not engine.use_kv_cache
        out = await engine.generate([5, 6], SamplingParams(max_new_tokens=6, seed=1))
        await engine.close()
        return out

    out = asyncio.run(run())
    assert _max_diff(out.logprobs, hf_logprobs(d, None, [5, 6], out.token_ids)) <= 1e-4


def test_invalid_inputs_are_refused(model_dirs):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(max_new_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="inflight_policy"):
        EngineConfig(backend="hf", model_path="x", inflight_policy="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="server_urls"):
        EngineConfig(backend="vllm_server")
    with pytest.raises(ValueError, match="differ in length"):
        GenerationResult([1, 2], [0.0], [0, 0], "stop")
    with pytest.raises(ValueError, match="finish_reason"):
        GenerationResult([1], [0.0], [0], "eos")

    async def run():
        engine = _engine(model_dirs["dense"], max_model_len=8)
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.generate(list(range(2, 12)), SamplingParams(max_new_tokens=2))
        out = await engine.generate([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=50, seed=0))
        await engine.close()
        return out

    out = asyncio.run(run())
    assert len(out.token_ids) <= 3  # capped by max_model_len=8
