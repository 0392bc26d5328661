"""Async HTTP client for a separately launched rollout server: ``vllm serve`` or ``rollout/server.py``.

Generation is token-in/token-out through the completions API: ``prompt`` is a list of ids,
``return_token_ids`` gives the sampled ids back exactly, ``logprobs=0`` the sampled token's log-prob.
The server must be started with ``--logprobs-mode processed_logprobs`` (vLLM) so those log-probs
describe the distribution actually sampled; the client cannot check this from outside, so
``check_server`` compares one request against ``score`` at T=1 only as a smoke test.

Versions. A server may report per-token ``weight_versions`` spans in each choice (``server.py`` does);
if it does not (vLLM's completions route), the client labels every token with the version current
when the request was sent. ``generate`` waits while this client's weight update is in progress, and
under ``inflight_policy="abort"`` in-flight requests are aborted at each update, so the label is exact.
Under ``"keep"`` a request that spans an update on a server without spans cannot be attributed:
the client raises rather than record wrong versions.

Weights. ``weight_transport="nccl"`` (GPU-ONLY, NOT TESTED here): vLLM's dev routes
(/pause, /init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update,
/resume; server started with VLLM_SERVER_DEV_MODE=1 and ``--weight-transfer-config '{"backend":"nccl"}'``),
tensors broadcast from this process as NCCL rank 0. ``"reload"``: the update is POSTed as one
safetensors blob to ``/sao/update_weights`` (only ``rollout/server.py`` has that route).
Every request has a timeout; every error names the server URL.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import torch

from megatron_sao.rollout.engine import EngineConfig, GenerationResult, SamplingParams, WeightBucket
from megatron_sao.rollout.vllm_weight_transport import broadcast_bucket, bucket_bytes, bucket_update_info


class ServerError(RuntimeError):
    """A request to a rollout server failed; the message names the URL and route."""


class VLLMServerClient:
    """``RolloutEngine`` over HTTP. One client per server URL."""

    def __init__(self, url: str, cfg: EngineConfig) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"server url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.cfg = cfg
        self.name = f"server:{self.url}"
        self.version = 0
        self.model = cfg.model_path or None
        kind = cfg.weight_transport
        self.transport = ("nccl" if torch.cuda.is_available() else "reload") if kind == "auto" else kind
        self._session = None
        self._idle = asyncio.Event()  # set when no weight update is in progress
        self._idle.set()
        self._inflight = 0
        self._group = None  # NCCL communicator (GPU only)
        self.last_update_bytes = 0

    # ------------------------------------------------------------------ HTTP plumbing
    async def _http(self):
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _request(self, method: str, route: str, *, timeout_s: float, json: Any = None,
                       data: bytes | None = None, params: dict | None = None) -> Any:
        import aiohttp

        session = await self._http()
        where = f"{method} {self.url}{route}"
        try:
            async with session.request(method, self.url + route, json=json, data=data, params=params,
                                       timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                body = await resp.text()
                if resp.status >= 400:
                    raise ServerError(f"{where} -> HTTP {resp.status}: {body[:500]}")
                if not body:
                    return None
                try:
                    return await resp.json(content_type=None)
                except ValueError:
                    return body
        except asyncio.TimeoutError as e:
            raise ServerError(f"{where} timed out after {timeout_s:.1f}s") from e
        except aiohttp.ClientError as e:
            raise ServerError(f"{where} failed: {type(e).__name__}: {e}") from e

    async def _control(self, method: str, route: str, **kw) -> Any:
        return await self._request(method, route, timeout_s=self.cfg.control_timeout_s, **kw)

    # ------------------------------------------------------------------ RolloutEngine
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationResult:
        if not prompt_ids:
            raise ValueError(f"{self.name}: generate got an empty prompt")
        await self._idle.wait()
        start_version = self.version
        body = {
            "prompt": list(prompt_ids), "max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "top_k": sampling.top_k, "stop_token_ids": list(sampling.stop_token_ids),
            "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False, "n": 1,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if self.model:
            body["model"] = self.model
        self._inflight += 1
        try:
            resp = await self._request("POST", "/v1/completions", json=body, timeout_s=self.cfg.request_timeout_s)
        finally:
            self._inflight -= 1
        try:
            choice = resp["choices"][0]
            token_ids = [int(t) for t in choice["token_ids"]]
            logprobs = [float(x) for x in (choice["logprobs"] or {}).get("token_logprobs", [])] if token_ids else []
            reason = choice["finish_reason"]
        except (KeyError, IndexError, TypeError) as e:
            raise ServerError(f"POST {self.url}/v1/completions: malformed response ({e!r}): {str(resp)[:300]}") from e
        if len(logprobs) != len(token_ids):
            raise ServerError(f"{self.url}: {len(token_ids)} tokens but {len(logprobs)} log-probs (is logprobs=0 honoured?)")
        if reason not in ("stop", "length", "abort"):
            raise ServerError(f"{self.url}: unexpected finish_reason {reason!r}")
        spans = choice.get("weight_versions")
        if spans:
            versions = [-1] * len(token_ids)
            for s in spans:
                for i in range(int(s["start"]), min(int(s["end"]), len(token_ids))):
                    versions[i] = int(s["version"])
            if -1 in versions:
                raise ServerError(f"{self.url}: weight_versions {spans} do not cover {len(token_ids)} tokens")
        elif self.version != start_version and self.cfg.inflight_policy == "keep":
            raise ServerError(
                f"{self.url}: request spanned a weight update (v{start_version}->v{self.version}) and the server "
                "reports no weight_versions; use inflight_policy='abort' with this server"
            )
        else:
            versions = [start_version] * len(token_ids)
        return GenerationResult(token_ids, logprobs, versions, reason)

    async def score(self, token_ids: list[int], start: int) -> list[float]:
        """Log-probs (T=1) of ``token_ids[start:]`` via ``prompt_logprobs``, for weight-sync checks."""
        body = {"prompt": list(token_ids), "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
        if self.model:
            body["model"] = self.model
        resp = await self._request("POST", "/v1/completions", json=body, timeout_s=self.cfg.request_timeout_s)
        plp = resp["choices"][0].get("prompt_logprobs") or resp.get("prompt_logprobs")
        if plp is None:
            raise ServerError(f"{self.url}: response has no prompt_logprobs")
        return [float(plp[i][str(token_ids[i])]["logprob"]) for i in range(start, len(token_ids))]

    async def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        buckets = [list(b) for b in buckets]
        self._idle.clear()  # new generate calls wait until the new weights are live
        try:
            if self.transport == "nccl":
                await self._update_nccl(buckets, version)
            else:
                await self._update_http(buckets, version)
            self.version = version
        finally:
            self._idle.set()

    async def _update_http(self, buckets: list[WeightBucket], version: int) -> None:
        from safetensors.torch import save

        blob = await asyncio.to_thread(
            lambda: save({n: t.detach().to("cpu").contiguous() for b in buckets for n, t in b})
        )
        self.last_update_bytes = len(blob)
        await self._control("POST", "/sao/update_weights", data=blob,
                            params={"version": str(version), "inflight_policy": self.cfg.inflight_policy})

    async def init_weight_transfer(self, world_size: int) -> None:
        """GPU-only: open the NCCL group (this process = rank 0, server workers from rank 1)."""
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        rendezvous = {"master_address": self.cfg.weight_transfer_master_address,
                      "master_port": self.cfg.weight_transfer_master_port, "world_size": world_size}
        init = asyncio.ensure_future(self._control(
            "POST", "/init_weight_transfer_engine",
            json={"init_info": {**rendezvous, "rank_offset": 1, "packed": False}}))
        self._group = await asyncio.to_thread(trainer_init, rendezvous, 0)
        await init

    async def _update_nccl(self, buckets: list[WeightBucket], version: int) -> None:
        if self._group is None:
            await self.init_weight_transfer(world_size=1 + self.cfg.tensor_parallel_size)
        await self._control("POST", "/pause", params={"mode": self.cfg.inflight_policy})
        try:
            await self._control("POST", "/start_weight_update")
            sent = 0
            for bucket in buckets:
                info = bucket_update_info(bucket)
                recv = asyncio.ensure_future(self._control("POST", "/update_weights", json={"update_info": info}))
                await asyncio.to_thread(broadcast_bucket, self._group, bucket)
                await recv
                sent += bucket_bytes([bucket])
            await self._control("POST", "/finish_weight_update", json={"weight_version": str(version)})
            self.last_update_bytes = sent
        finally:
            await self._control("POST", "/resume")

    async def pause(self) -> None:
        await self._control("POST", "/pause", params={"mode": "keep"})

    async def resume(self) -> None:
        await self._control("POST", "/resume")

    async def health(self) -> bool:
        try:
            await self._control("GET", "/health")
            return True
        except ServerError:
            return False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
