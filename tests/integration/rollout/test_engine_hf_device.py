"""The HF rollout engine keeps every tensor on its own device (it is colocated mode's fallback engine).

The bug this pins: the engine made its inputs (ids, masks, positions) on the host while the model sat on
``cfg.device``, sampled with ``torch.multinomial`` and a host generator, and ``trainer/components.py``
never passed a device, so it could not generate on a GPU at all. A CPU build has no second device, so
the test runs the engine's worker thread under the collective guard's shadow placement
(``distributed/collective_guard.py``): the engine is told the pretend accelerator, tensors that engine
code makes without naming a device count as host tensors, and a forward hook on the model fails every
host input, as CUDA would. A second mode flags a host generator used on an accelerator tensor.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_sao.distributed import collective_guard as guard
from megatron_sao.rollout.engines.hf_engine import HFEngine
from megatron_sao.rollout.engines.protocol import SamplingParams
from tests.engine_fixtures import make_tiny_model

pytestmark = pytest.mark.timeout(300)


class _GeneratorOnAnotherDevice(TorchFunctionMode):
    """Records calls that pair a host generator with an accelerator tensor (CUDA raises on those)."""

    def __init__(self, violations: list[str]) -> None:
        super().__init__()
        self.violations = violations

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("generator") is not None:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if any(not guard.is_host(t) for t in tensors):
                self.violations.append(f"{getattr(func, '__name__', func)} with a host generator on a device tensor")
        return func(*args, **kwargs)


class _OnPretendAccelerator(HFEngine):
    """The engine with its worker thread under shadow placement; the model fails host inputs."""

    def __init__(self, model, **kw) -> None:
        self.violations: list[str] = []

        def check_inputs(module, args, kwargs):
            named = dict(kwargs, **({"input_ids": args[0]} if args else {}))
            for name, t in named.items():
                if isinstance(t, torch.Tensor) and guard.is_host(t):
                    self.violations.append(f"model input {name} made on the host")
        model.register_forward_pre_hook(check_inputs, with_kwargs=True)
        super().__init__(model, device=guard.PRETEND_DEVICE, **kw)

    def _run(self) -> None:
        with guard._ShadowPlacement(), _GeneratorOnAnotherDevice(self.violations):
            super()._run()


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("hf_device"), "dense")


def test_inputs_and_sampling_stay_on_the_engine_device(dense_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(dense_dir), dtype=torch.float32)

    async def go():
        engine = _OnPretendAccelerator(model, max_model_len=64, max_batch_size=4)
        try:
            # Two requests decode together (the batched KV path), then a weight-check score.
            outs = await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=6, seed=i))
                                          for i, p in enumerate(([5, 6, 7], [9, 8]))))
            scores = await engine.score([5, 6, 7, 8], 1)
            return engine, outs, scores
        finally:
            await engine.close()
    engine, outs, scores = asyncio.run(go())
    assert [len(o.token_ids) for o in outs] == [6, 6] and len(scores) == 3  # it really generated
    assert engine.violations == []


def test_same_seed_same_tokens_on_any_device_placement(dense_dir):
    """The host generator draws the uniforms, so the sampled ids do not depend on where logits live."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(dense_dir), dtype=torch.float32)

    async def go(engine):
        try:
            return await engine.generate([5, 6, 7], SamplingParams(max_new_tokens=8, seed=3))
        finally:
            await engine.close()
    a = asyncio.run(go(HFEngine(model, max_model_len=64)))
    b = asyncio.run(go(_OnPretendAccelerator(model, max_model_len=64)))
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_the_trainer_gives_the_engine_a_device(monkeypatch, tmp_path):
    from megatron_sao.config import load_config
    from megatron_sao.trainer import components as C

    cfg = load_config(None, [f"run.dir={tmp_path}"])
    assert C.engine_config(cfg, tmp_path).device == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert C.engine_config(cfg, tmp_path).device == "cuda"  # the rank's current GPU (init_parallel sets it)
