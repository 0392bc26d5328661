"""Async HTTP client for one separately launched rollout server: ``vllm serve`` or ``rollout/engines/http_server.py``.

Generation is token-in/token-out through vLLM's ``POST /inference/v1/generate`` (``vllm serve
--enable-scale-out``; ``rollout/engines/http_server.py`` serves the same route): ``token_ids`` in, sampled
``token_ids`` out, ``logprobs=0`` the sampled token's log-prob, and per-choice ``weight_versions`` spans:
vLLM labels every output token with the weight version that sampled it (the label the trainer set with
``finish_weight_update(weight_version)``), so a request that spans an update under
``inflight_policy="keep"`` is attributed exactly. The server must run ``--logprobs-mode
processed_logprobs`` so the log-probs describe the distribution actually sampled. A server without the
route (scale-out disabled) is driven through ``/v1/completions`` with ``return_weight_versions`` (vLLM
builds that return spans there); if its answers carry no spans, every token is labelled with the
version current when the request was sent, generation waits while this client updates weights, and
under ``keep`` a request that spanned an update raises instead of recording wrong versions.

Weights are streamed bucket by bucket (``begin_weight_update`` / ``push_weight_bucket`` /
``finish_weight_update``):

* ``nccl`` (GPU) / ``gloo`` (CPU): vLLM's routes (``VLLM_SERVER_DEV_MODE=1``): ``/pause``,
  ``/start_weight_update``, ``/update_weights`` per bucket while this process broadcasts it as rank 0
  of the transfer group, ``/finish_weight_update`` with the version label, ``/resume``. The group is
  one for every server of the update (``weights/server_group.py``, formed by ``WeightSync``
  through ``join_transfer_group``: ``/init_weight_transfer_engine`` with this server's rank offset);
  a client used on its own (``update_weights``) forms a group of its own server at its own port. A
  bucket sent again after a failed receive is preceded by ``/collective_rpc``
  ``sao_reopen_weight_update`` (vLLM ends a worker's update session on a receive error). The
  server's TP*PP is checked against ``GET /get_world_size`` at connect.
* ``reload``: each bucket POSTed as safetensors bytes to ``rollout/engines/http_server.py``'s ``/sao/`` routes.

Every request has a timeout; every error names the server URL.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import torch

from megatron_sao.rollout.engines.protocol import (
    NEUTRAL_SAMPLING,
    EngineConfig,
    GenerationResult,
    SamplingParams,
)
from megatron_sao.rollout.engines.routes import decode_b64_routes, num_experts_of, scored_routes
from megatron_sao.weights.buckets import WeightBucket, bucket_bytes, serialize_bucket


class ServerError(RuntimeError):
    """A request to a rollout server failed; the message names the URL and route."""


def expand_spans(spans: list[dict], n: int, where: str) -> list[int]:
    """Per-token versions from ``weight_versions`` spans ``[{"version", "start", "end"}]``."""
    versions = [-1] * n
    for s in spans:
        try:
            v = int(s["version"])
        except ValueError:
            raise ServerError(f"{where}: weight version label {s['version']!r} is not an int (the trainer labels "
                              "every update with its version; was the server's label set?)") from None
        for i in range(int(s["start"]), min(int(s["end"]), n)):
            versions[i] = v
    if -1 in versions:
        raise ServerError(f"{where}: weight_versions {spans} do not cover {n} tokens")
    return versions


class VLLMServerClient:
    """``RolloutEngine`` over HTTP. One client per server URL; ``index`` picks its transfer port."""

    def __init__(self, url: str, cfg: EngineConfig, index: int = 0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"server url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.cfg = cfg
        self.index = index
        self.name = f"server:{self.url}"
        self.version = 0
        self.model = cfg.model_path or None
        self._num_experts: int | None = None  # routes: read from the model's config.json on first use
        self.transport: str | None = None  # resolved by connect(): reload | nccl | gloo
        self.route: str | None = None  # resolved by connect(): generate | completions
        self.kind: str | None = None  # "sao" (rollout/engines/http_server.py) or "vllm"
        self._session = None
        self._connect_lock = asyncio.Lock()
        self._idle = asyncio.Event()  # set when no weight update is in progress
        self._idle.set()
        self._solo = None  # a transfer group of this server alone, when used without WeightSync
        self._update_version: int | None = None
        self._session_open = False  # vLLM's workers are inside a weight-update session (start ran)
        self.last_update_bytes = 0

    # ------------------------------------------------------------------ HTTP plumbing
    async def _http(self):
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _request(self, method: str, route: str, *, timeout_s: float, json: Any = None,
                       data: bytes | None = None, params: dict | None = None, ok_statuses: tuple = ()) -> Any:
        import aiohttp

        session = await self._http()
        where = f"{method} {self.url}{route}"
        try:
            async with session.request(method, self.url + route, json=json, data=data, params=params,
                                       timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                body = await resp.text()
                if resp.status in ok_statuses:
                    return resp.status
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

    # ------------------------------------------------------------------ connect (once)
    async def connect(self) -> None:
        """Find out what the server is and offers; label its weights with this client's version."""
        async with self._connect_lock:
            if self.kind is not None:
                return
            info = await self._control("GET", "/sao/info", ok_statuses=(404,))
            kind = "sao" if isinstance(info, dict) else "vllm"
            transport = self.cfg.weight_transport
            if transport == "auto":
                transport = "reload" if kind == "sao" else ("nccl" if torch.cuda.is_available() else "gloo")
            if kind == "sao" and transport != "reload":
                raise ServerError(f"{self.url} is a rollout/engines/http_server.py server: "
                                  f"it takes weight_transport 'reload', "
                                  f"not {transport!r}")
            if kind == "vllm":
                if transport == "reload":
                    raise ServerError(f"{self.url} is a vllm server: weight_transport must be nccl (GPU) or gloo (CPU)")
                got = await self._control("GET", "/get_world_size", params={"include_dp": "false"})
                if int(got["world_size"]) != self.cfg.tensor_parallel_size:
                    raise ServerError(f"{self.url} runs {got['world_size']} workers (TP*PP) but the config says "
                                      f"{self.cfg.tensor_parallel_size} (cluster.rollout_tp): the weight-transfer "
                                      "group would have the wrong world size")
                await self._control("POST", "/update_weight_version", json={"new_version": str(self.version)})
            probe = {"token_ids": [0], "sampling_params": {"max_tokens": 1, "detokenize": False}}
            if self.model:
                probe["model"] = self.model
            status = await self._request("POST", "/inference/v1/generate", json=probe,
                                         timeout_s=self.cfg.request_timeout_s, ok_statuses=(403, 404))
            self.route = "completions" if status in (403, 404) else "generate"
            self.kind, self.transport = kind, transport

    # ------------------------------------------------------------------ RolloutEngine
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationResult:
        if not prompt_ids:
            raise ValueError(f"{self.name}: generate got an empty prompt")
        await self.connect()
        if self.route == "generate":
            return await self._generate_tokens(prompt_ids, sampling)
        return await self._generate_completions(prompt_ids, sampling)

    def _sampling_body(self, sampling: SamplingParams) -> dict:
        # Every field that shapes the distribution is sent, the neutral ones included: a field left out
        # takes the model's generation_config.json default on vLLM's completions route (e.g. a
        # repetition_penalty), and the recorded log-probs would no longer be the learner's softmax.
        body = {"max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
                "top_k": sampling.top_k, **NEUTRAL_SAMPLING, "stop_token_ids": list(sampling.stop_token_ids),
                "logprobs": 0}
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.return_routes:  # the server runs with --enable-return-routed-experts (launch plan)
            body["routed_experts_prompt_start"] = sampling.routes_start
        return body

    def _routes(self, choice: dict, where: str) -> torch.Tensor:
        """The choice's base64 routed_experts (the request asked for them)."""
        if self._num_experts is None:  # cached only once found: a failed lookup says the same every time
            found = num_experts_of(self.cfg.model_path) if self.cfg.model_path else 0
            if not found:
                raise ServerError(f"{where}: routes need EngineConfig.model_path of a Mixture-of-Experts model "
                                  "(its config.json names the expert count)")
            self._num_experts = found
        return decode_b64_routes(choice.get("routed_experts"), self._num_experts, where)

    async def _generate_tokens(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationResult:
        where = f"POST {self.url}/inference/v1/generate"
        body = {"token_ids": list(prompt_ids),
                "sampling_params": {**self._sampling_body(sampling), "detokenize": False}}
        if self.model:
            body["model"] = self.model
        resp = await self._request("POST", "/inference/v1/generate", json=body, timeout_s=self.cfg.request_timeout_s)
        try:
            choice = resp["choices"][0]
            token_ids = [int(t) for t in choice["token_ids"] or []]
            content = (choice.get("logprobs") or {}).get("content") or []
            logprobs = [float(c["logprob"]) for c in content]
            reason, spans = choice["finish_reason"], choice.get("weight_versions")
        except (KeyError, IndexError, TypeError) as e:
            raise ServerError(f"{where}: malformed response ({e!r}): {str(resp)[:300]}") from e
        if spans is None:
            raise ServerError(f"{where}: the response has no weight_versions (vLLM without token provenance?)")
        return self._result(where, token_ids, logprobs, reason, expand_spans(spans, len(token_ids), where),
                            self._routes(choice, where) if sampling.return_routes else None)

    async def _generate_completions(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationResult:
        where = f"POST {self.url}/v1/completions"
        if self.cfg.inflight_policy == "abort" or self._update_version is not None:
            await self._idle.wait()
        start_version = self.version
        body = {"prompt": list(prompt_ids), **self._sampling_body(sampling), "return_token_ids": True,
                "return_weight_versions": True, "skip_special_tokens": False, "n": 1}
        if self.model:
            body["model"] = self.model
        resp = await self._request("POST", "/v1/completions", json=body, timeout_s=self.cfg.request_timeout_s)
        try:
            choice = resp["choices"][0]
            token_ids = [int(t) for t in choice["token_ids"]]
            logprobs = [float(x) for x in (choice["logprobs"] or {}).get("token_logprobs", [])] if token_ids else []
            reason, spans = choice["finish_reason"], choice.get("weight_versions")
        except (KeyError, IndexError, TypeError) as e:
            raise ServerError(f"{where}: malformed response ({e!r}): {str(resp)[:300]}") from e
        if spans:
            versions = expand_spans(spans, len(token_ids), where)
        elif self.version != start_version and self.cfg.inflight_policy == "keep":
            raise ServerError(f"{where}: request spanned a weight update (v{start_version}->v{self.version}) and the "
                              "server reports no weight_versions; start vllm serve with --enable-scale-out or use "
                              "inflight_policy='abort'")
        else:
            versions = [start_version] * len(token_ids)
        return self._result(where, token_ids, logprobs, reason, versions,
                            self._routes(choice, where) if sampling.return_routes else None)

    @staticmethod
    def _result(where: str, token_ids: list[int], logprobs: list[float], reason: str,
                versions: list[int], routes: torch.Tensor | None = None) -> GenerationResult:
        if len(logprobs) != len(token_ids):
            raise ServerError(f"{where}: {len(token_ids)} tokens but {len(logprobs)} log-probs "
                              f"(is logprobs=0 honoured?)")
        if reason not in ("stop", "length", "abort"):
            raise ServerError(f"{where}: unexpected finish_reason {reason!r}")
        return GenerationResult(token_ids, logprobs, versions, reason, routes)

    async def score(self, token_ids: list[int], start: int) -> list[float]:
        """Log-probs (T=1) of ``token_ids[start:]`` via ``prompt_logprobs``, for weight-sync checks."""
        return (await self._score(token_ids, start, routes=False))[0]

    async def score_routed(self, token_ids: list[int], start: int) -> tuple[list[float], torch.Tensor]:
        """``score`` and the experts the server routed every token of ``token_ids`` to ([T, layers, topk]:
        ``routed_experts_prompt_start`` 0; the one sampled token has no route), for the weight-sync check
        under routing replay."""
        lps, routes = await self._score(token_ids, start, routes=True)
        return lps, scored_routes(routes, len(token_ids), self.url, ServerError)

    async def _score(self, token_ids: list[int], start: int, routes: bool) -> tuple[list[float], torch.Tensor | None]:
        where = f"POST {self.url}/v1/completions"
        body = {"prompt": list(token_ids), "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
        if routes:
            body["routed_experts_prompt_start"] = 0
        if self.model:
            body["model"] = self.model
        resp = await self._request("POST", "/v1/completions", json=body, timeout_s=self.cfg.request_timeout_s)
        choice = resp["choices"][0]
        plp = choice.get("prompt_logprobs") or resp.get("prompt_logprobs")
        if plp is None:
            raise ServerError(f"{self.url}: response has no prompt_logprobs")
        lps = [float(plp[i][str(token_ids[i])]["logprob"]) for i in range(start, len(token_ids))]
        return lps, self._routes(choice, where) if routes else None

    # ------------------------------------------------------------------ weights (streamed)
    async def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        await self.begin_weight_update(version)
        try:
            for bucket in buckets:
                await self.push_weight_bucket(list(bucket))
        except BaseException:
            await self.abort_weight_update()
            raise
        await self.finish_weight_update(version)

    async def begin_weight_update(self, version: int) -> None:
        await self.connect()
        if self._update_version is not None:
            raise ServerError(f"{self.url}: begin_weight_update v{version} "
                              f"while v{self._update_version} is in progress")
        self._update_version, self.last_update_bytes = version, 0
        self._idle.clear()  # completions without spans: new requests wait for the new weights
        try:
            if self.transport == "reload":
                await self._control("POST", "/sao/start_weight_update", params={"version": str(version)})
                return
            if self._solo is not None:
                self._solo.new_update()
            await self._control("POST", "/pause", params={"mode": self.cfg.inflight_policy})
            await self._control("POST", "/start_weight_update")
            self._session_open = True
        except BaseException:
            await self.abort_weight_update()
            raise

    # ------------------------------------------------------------------ the shared transfer group
    @property
    def group_transport(self) -> str | None:
        """``nccl`` / ``gloo`` when this server takes weights by broadcast (known after ``connect``)."""
        return self.transport if self.transport in ("nccl", "gloo") else None

    @property
    def transfer_world_size(self) -> int:
        return self.cfg.tensor_parallel_size

    @property
    def group_wait_s(self) -> float:
        # Forming a group across nodes can take longer than a control call: the request timeout bounds it.
        return max(self.cfg.control_timeout_s, self.cfg.request_timeout_s)

    async def join_transfer_group(self, init_info: dict) -> None:
        """Make this server's workers join a transfer group (they block in it until every rank came)."""
        await self._request("POST", "/init_weight_transfer_engine", timeout_s=self.group_wait_s,
                            json={"init_info": init_info})

    async def receive_bucket(self, update_info: dict) -> None:
        """Make this server's workers receive one bucket from the group's rank 0 (which broadcasts it)."""
        if self._update_version is None:
            raise ServerError(f"{self.url}: receive_bucket outside begin/finish_weight_update")
        await self._control("POST", "/update_weights", json={"update_info": update_info})

    async def reopen_update(self) -> None:
        """After a failed receive, let this server's update take a bucket again (vLLM ends a worker's
        update session on a receive error; ``vllm_worker/extension.py::sao_reopen_weight_update``)."""
        if self._update_version is None:
            raise ServerError(f"{self.url}: reopen_update outside begin/finish_weight_update")
        await self._control("POST", "/collective_rpc", json={"method": "sao_reopen_weight_update"})

    async def push_weight_bucket(self, bucket: WeightBucket) -> None:
        if self._update_version is None:
            raise ServerError(f"{self.url}: push_weight_bucket outside begin/finish_weight_update")
        if self.transport == "reload":
            blob = await asyncio.to_thread(serialize_bucket, bucket)
            await self._control("POST", "/sao/update_weights", data=blob)
            self.last_update_bytes += len(blob)
            return
        if self._solo is None:
            from megatron_sao.weights.server_group import ServerTransferGroup

            self._solo = ServerTransferGroup(self.cfg.weight_transfer_master_address,
                                             (self.cfg.transfer_port(self.index),), self.transport, self.group_wait_s)
        failed = await self._solo.ensure([self]) or await self._solo.send_bucket(list(bucket))
        if failed:
            raise ServerError(f"{self.url}: {failed[self]}")
        self.last_update_bytes += bucket_bytes(bucket)

    async def finish_weight_update(self, version: int) -> None:
        if self._update_version != version:
            raise ServerError(f"{self.url}: finish_weight_update v{version} but the update in progress is "
                              f"{self._update_version}")
        try:
            if self.transport == "reload":
                await self._control("POST", "/sao/finish_weight_update",
                                    params={"version": str(version), "inflight_policy": self.cfg.inflight_policy})
            else:
                # The label vLLM stamps on every token sampled from here on (weight_versions spans).
                await self._control("POST", "/finish_weight_update", json={"weight_version": str(version)})
                self._session_open = False
                await self._control("POST", "/resume")
            self.version = version
        except BaseException:
            await self.abort_weight_update()
            raise
        finally:
            self._update_version = None
            self._idle.set()

    async def abort_weight_update(self) -> None:
        """Best effort: drop a half-done update and resume; the caller treats this server as broken.

        A vLLM server's workers must leave their weight-update session (``/finish_weight_update``
        without a version: the label stays the old one), or every later ``/start_weight_update`` is
        refused ("already active") and the server could never rejoin. Its weights are then not usable:
        layers that received all their tensors hold the new ones, and a layer that received only some
        holds uninitialised memory in the others (vLLM's ``finalize_layerwise_reload``), so the pool
        requires a complete update before the server serves again (``ServerPool.revive``)."""
        if self._update_version is None:
            return
        self._update_version = None
        self._idle.set()
        if self.transport == "reload":
            calls = [("/sao/abort_weight_update", None)]
        else:
            calls = [("/finish_weight_update", {})] if self._session_open else []
            calls.append(("/resume", None))
        self._session_open = False
        for route, body in calls:
            try:
                await self._control("POST", route, json=body)
            except ServerError:
                pass

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
        solo, self._solo = self._solo, None
        if solo is not None:
            solo.close()
        if self._session is not None:
            await self._session.close()
            self._session = None
