"""WeightSync: versioned, streamed pushes to several engines, timeouts and errors naming the engine,
failed engines left out (strict=False), check mode."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_sao.rollout.engines.hf_engine import HFEngine
from megatron_sao.rollout.engines.protocol import SamplingParams
from megatron_sao.weights.sync import WeightSync, WeightSyncError
from tests.engine_fixtures import ScriptedEngine, hf_logprobs, load_checkpoint, make_tiny_model, perturbed

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("ws_models"), "moe")


def _engine(d, name: str) -> HFEngine:
    from transformers import AutoModelForCausalLM

    return HFEngine(AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32), max_model_len=128, name=name)


def _ok_engine() -> ScriptedEngine:
    """No script and no score: only its streamed-update surface is used (the boundary of these tests)."""
    return ScriptedEngine(name="ok-engine")


def _slow_engine() -> ScriptedEngine:
    """Stands in for a hung rollout engine."""
    return ScriptedEngine(name="slow-engine", push_delay=30)


def _broken_engine() -> ScriptedEngine:
    return ScriptedEngine(name="broken-engine", push_error=OSError("connection reset"))


def _buckets(state: dict[str, torch.Tensor], size: int = 5):
    """A generator, like the trainer's export: consumed once."""
    names = list(state)
    for i in range(0, len(names), size):
        yield [(n, state[n]) for n in names[i : i + size]]


def test_push_to_two_engines_with_check(moe_dir):
    new = perturbed(load_checkpoint(moe_dir), seed=5)
    prompt, probe = [5, 6, 7], [9, 10, 11, 12, 13, 14]
    reference = hf_logprobs(moe_dir, new, prompt, probe)  # what the trainer would compute

    async def run():
        engines = [_engine(moe_dir, "a"), _engine(moe_dir, "b")]
        sync = WeightSync(engines, timeout_s=60, check=True, atol=1e-4)
        metrics = await sync.push(_buckets(new), version=3, check_tokens=prompt + probe, check_prompt_len=3,
                                  reference_logprobs=reference)
        outs = [await e.generate(prompt, SamplingParams(max_new_tokens=5, seed=0)) for e in engines]
        for e in engines:
            await e.close()
        return engines, metrics, outs

    engines, metrics, outs = asyncio.run(run())
    assert [e.version for e in engines] == [3, 3]
    assert all(o.versions == [3] * len(o.token_ids) for o in outs)
    assert metrics.version == 3 and len(metrics.per_engine_seconds) == 2 and metrics.buckets == -(-len(new) // 5)
    assert metrics.bytes == sum(t.numel() * t.element_size() for t in new.values())
    assert metrics.bytes_per_s > 0 and metrics.max_abs_logprob_diff <= 1e-4
    assert set(metrics.as_dict()) >= {"weight_sync/seconds", "weight_sync/bytes", "weight_sync/bytes_per_s"}


def test_check_detects_a_wrong_refit(moe_dir):
    """Reference log-probs from other weights (a silently corrupted refit) must fail the check."""
    new = perturbed(load_checkpoint(moe_dir), seed=5)
    prompt, probe = [5, 6, 7], [9, 10, 11, 12]
    stale_reference = hf_logprobs(moe_dir, None, prompt, probe)

    async def run():
        engine = _engine(moe_dir, "only")
        sync = WeightSync([engine], timeout_s=60, check=True, atol=1e-3)
        try:
            with pytest.raises(WeightSyncError, match=r"weight check failed on engine 0 \(only\)"):
                await sync.push(_buckets(new), 1, check_tokens=prompt + probe, check_prompt_len=3,
                                reference_logprobs=stale_reference)
        finally:
            await engine.close()

    asyncio.run(run())


def test_timeout_and_failure_name_the_engine(moe_dir):
    state = load_checkpoint(moe_dir)

    async def run():
        with pytest.raises(WeightSyncError,
                           match=r"engine 1 \(slow-engine\): bucket of weight sync v1 timed out after 0.2s"):
            await WeightSync([_ok_engine(), _slow_engine()], timeout_s=0.2).push(_buckets(state), 1)
        with pytest.raises(WeightSyncError, match=r"engine 0 \(broken-engine\): bucket of weight sync v1 failed: "
                                                  r"OSError: connection reset"):
            await WeightSync([_broken_engine()], timeout_s=5).push(_buckets(state), 1)

    asyncio.run(run())


def test_a_failed_engine_is_left_out_and_reported_when_not_strict(moe_dir):
    """The rollout side's mode: the healthy engines get the whole update, the failed one none of
    the buckets after its failure, and the metrics name it (the caller takes it out of service)."""
    state = load_checkpoint(moe_dir)
    ok, broken, ok2 = _ok_engine(), _broken_engine(), _ok_engine()

    async def run():
        sync = WeightSync([ok, broken, ok2], timeout_s=5, strict=False, labels=["a", "b", "c"])
        return await sync.push(_buckets(state), 4)

    m = asyncio.run(run())
    n = -(-len(state) // 5)
    assert (ok.version, ok2.version, broken.version) == (4, 4, 0) and ok.buckets == ok2.buckets == n
    assert list(m.failed) == ["b"] and "connection reset" in m.failed["b"] and broken.aborted
    assert set(m.per_engine_seconds) == {"a", "c"} and m.as_dict()["weight_sync/engines_failed"] == 1


def test_bad_arguments_are_refused(moe_dir):
    with pytest.raises(ValueError, match="at least one"):
        WeightSync([], timeout_s=1)
    with pytest.raises(ValueError, match="timeout_s"):
        WeightSync([_ok_engine()], timeout_s=0)

    async def run():
        with pytest.raises(ValueError, match="check_tokens"):
            await WeightSync([_ok_engine()], timeout_s=1, check=True).push([], 1)
        with pytest.raises(ValueError, match="version"):
            await WeightSync([_ok_engine()], timeout_s=1).push([], -1)
        with pytest.raises(TypeError, match="no score"):
            await WeightSync([_ok_engine()], timeout_s=1).verify(_ok_engine(), [1, 2, 3], [0.0, 0.0], 1e-3)

    asyncio.run(run())


def test_check_every_n_checks_only_the_versions_it_names():
    """rollout.weight_sync_check_every: the trainer computes the reference only for due versions, and
    a due version without one is refused, not silently unchecked."""
    from megatron_sao.weights.sync import check_due

    assert [v for v in range(1, 9) if check_due(v, 3)] == [3, 6]
    assert all(check_due(v, 1) for v in range(5))
    with pytest.raises(ValueError, match=">= 1"):
        WeightSync([_ok_engine()], timeout_s=5, check=True, check_every=0)
    bucket = [("w", torch.zeros(2))]

    async def run():
        sync = WeightSync([_ok_engine()], timeout_s=5, check=True, check_every=2)
        m = await sync.push([bucket], version=1)  # not due: no reference needed, none checked
        assert not m.logprob_diff and set(m.phase_seconds) >= {"begin", "buckets", "finish"}
        with pytest.raises(ValueError, match="check_every=2"):
            await sync.push([bucket], version=2)
    asyncio.run(run())
