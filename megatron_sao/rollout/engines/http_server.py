"""Serve any ``RolloutEngine`` (e.g. ``HFEngine`` on a CPU node) over the routes ``VLLMServerClient`` uses.

Lets the launcher run a rollout process without vLLM (fast to start: the CI's multi-process tests).
Routes (aiohttp):

* ``GET /health``, ``GET /weight_info`` -> ``{"weight_version": "N"}``, ``GET /sao/info`` (what it is)
* ``POST /inference/v1/generate``: vLLM's token-in/token-out route (``token_ids``, ``sampling_params``);
  returns ``token_ids``, ``logprobs.content[i].logprob`` and per-token ``weight_versions`` spans.
* ``POST /v1/completions``: token-id prompt only, ``n=1``, the same output in completions shape;
  ``prompt_logprobs`` (T=1) when asked, for weight checks (with ``routed_experts`` when
  ``routed_experts_prompt_start`` asks for them). Unsupported fields (``echo``, ``best_of``,
  penalties, text prompts...) are refused with HTTP 400 naming the field: they would change the
  sampled distribution or the output shape without the log-probs knowing.
* ``POST /pause?mode=keep|abort|wait``, ``POST /resume``
* streamed weight updates (safetensors body per bucket): ``POST /sao/start_weight_update?version=N``,
  ``POST /sao/update_weights``, ``POST /sao/finish_weight_update?version=N``, ``POST /sao/abort_weight_update``
* vLLM's weight-transfer routes answer 501 (this server takes the ``/sao/`` ones).

Run: ``sao serve-rollout CONFIG`` (``trainer/serve_rollout.py``) or
``python -m megatron_sao.rollout.engines.http_server --model DIR --port 8000``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
from typing import Any

import numpy as np

from megatron_sao.rollout.engines.factory import make_engine
from megatron_sao.rollout.engines.protocol import NEUTRAL_SAMPLING, EngineConfig, RolloutEngine, SamplingParams

_ALLOWED = {"prompt", "model", "max_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "seed", "logprobs",
            "return_token_ids", "skip_special_tokens", "n", "prompt_logprobs", "stream", "return_weight_versions",
            "routed_experts_prompt_start", *NEUTRAL_SAMPLING}
# Fields served only at one value (the HF engine samples plain temperature/top-k/top-p).
_NEUTRAL = {"n": 1, "stream": False, "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False,
            **NEUTRAL_SAMPLING}
_GENERATE_SAMPLING = {"max_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "seed", "logprobs", "n",
                      "detokenize", "routed_experts_prompt_start", *NEUTRAL_SAMPLING}


def _sampling(body: dict) -> SamplingParams:
    """Our SamplingParams from vLLM-style fields (ValueError names a bad one). ``routed_experts_prompt_start``
    asks for routes (routing replay; vLLM returns them whenever it runs with --enable-return-routed-experts)."""
    routes_start = body.get("routed_experts_prompt_start")
    return SamplingParams(
        max_new_tokens=int(body.get("max_tokens") or 16), temperature=float(body.get("temperature", 1.0)),
        top_p=float(body.get("top_p", 1.0)), top_k=max(int(body.get("top_k") or 0), 0),
        stop_token_ids=tuple(int(t) for t in body.get("stop_token_ids") or ()), seed=body.get("seed"),
        return_routes=routes_start is not None, routes_start=int(routes_start or 0),
    )


def _routes_b64(routes) -> str | None:
    """routed_experts as vLLM sends them: a base64 .npy array (rollout/engines/routes.py decodes it)."""
    if routes is None:
        return None
    buf = io.BytesIO()
    np.save(buf, routes.numpy(), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _spans(versions: list[int]) -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


def build_app(engine: RolloutEngine):
    """The aiohttp application exposing ``engine``."""
    from aiohttp import web

    def bad(msg: str, status: int = 400) -> web.Response:
        return web.json_response({"error": msg}, status=status)

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"}) if await engine.health() else bad("engine unhealthy", 503)

    async def weight_info(_: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(engine.version)})

    async def info(_: web.Request) -> web.Response:
        return web.json_response({"server": "sao", "engine": getattr(engine, "name", type(engine).__name__),
                                  "weight_version": str(engine.version)})

    async def generate_tokens(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return bad("body is not JSON")
        prompt, sp = body.get("token_ids"), body.get("sampling_params") or {}
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            return bad("'token_ids' must be a non-empty list of token ids")
        extra = sorted(set(sp) - _GENERATE_SAMPLING)
        if extra:
            return bad(f"unsupported sampling_params field(s) {extra}")
        if sp.get("n", 1) != 1 or sp.get("logprobs", 0) not in (0, None):
            return bad("sampling_params: only n=1 and logprobs=0 are served")
        off = sorted(k for k, want in NEUTRAL_SAMPLING.items() if sp.get(k, want) != want)
        if off:
            return bad(f"sampling_params {off} are served only at their neutral values {NEUTRAL_SAMPLING}")
        try:
            out = await engine.generate(prompt, _sampling(sp))
        except ValueError as e:
            return bad(str(e))
        content = [{"token_id": t, "logprob": lp} for t, lp in zip(out.token_ids, out.logprobs)]
        choice = {"index": 0, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                  "logprobs": {"content": content}, "weight_versions": _spans(out.versions),
                  "routed_experts": _routes_b64(out.routed_experts)}
        return web.json_response({"output_mode": "tokens", "choices": [choice]})

    async def score_prompt(prompt: list[int], routes_start) -> web.Response:
        """prompt_logprobs (the weight check), with the prompt's routes from ``routes_start`` on when asked
        (routing replay: the trainer's reference forward replays them)."""
        routes = None
        if routes_start is None:
            score = getattr(engine, "score", None)
            if score is None:
                return bad("this engine cannot score prompts (prompt_logprobs)", 501)
            lps = await score(prompt, 1)
        else:
            score = getattr(engine, "score_routed", None)
            if score is None:
                return bad("this engine cannot return the routes of a scored prompt", 501)
            if not 0 <= int(routes_start) < len(prompt):
                return bad(f"routed_experts_prompt_start must be in [0, {len(prompt) - 1}], got {routes_start}")
            lps, routed = await score(prompt, 1)
            routes = _routes_b64(routed[int(routes_start):])
        plp = [None] + [{str(t): {"logprob": lp}} for t, lp in zip(prompt[1:], lps)]
        return web.json_response({"choices": [{"index": 0, "token_ids": [], "finish_reason": "length",
                                               "prompt_logprobs": plp, "logprobs": None,
                                               "routed_experts": routes}]})

    async def completions(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return bad("body is not JSON")
        extra = sorted(set(body) - _ALLOWED)
        if extra:
            return bad(f"unsupported completion field(s) {extra}")
        for key, want in _NEUTRAL.items():
            if (key in body and body[key] not in (want, None)
                    and not (key == "logprobs" and body.get("prompt_logprobs") is not None)):
                return bad(f"field {key!r} must be {want!r} on this server, got {body[key]!r}")
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            return bad("'prompt' must be a non-empty list of token ids")
        try:
            if body.get("prompt_logprobs") is not None:
                return await score_prompt(prompt, body.get("routed_experts_prompt_start"))
            out = await engine.generate(prompt, _sampling(body))
        except ValueError as e:
            return bad(str(e))
        choice = {"index": 0, "text": "", "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                  "logprobs": {"token_logprobs": out.logprobs}, "weight_versions": _spans(out.versions),
                  "routed_experts": _routes_b64(out.routed_experts)}
        return web.json_response({"object": "text_completion", "choices": [choice]})

    async def pause(request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in ("keep", "abort", "wait"):
            return bad(f"mode must be keep|abort|wait, got {mode!r}")
        if mode == "abort" and hasattr(engine, "abort_all"):
            await engine.abort_all()
        if mode != "wait":  # "wait": in-flight requests finish; this engine has no drain-then-pause, so do nothing
            await engine.pause()
        return web.json_response({"status": "paused"})

    async def resume(_: web.Request) -> web.Response:
        await engine.resume()
        return web.json_response({"status": "resumed"})

    async def start_update(request: web.Request) -> web.Response:
        try:
            version = int(request.query["version"])
        except (KeyError, ValueError):
            return bad("query parameter 'version' (int) is required")
        try:
            await engine.begin_weight_update(version)
        except RuntimeError as e:
            return bad(str(e), 409)
        return web.json_response({"status": "started", "weight_version": str(version)})

    async def update_weights(request: web.Request) -> web.Response:
        from safetensors.torch import load

        blob = await request.read()
        try:
            state = await asyncio.to_thread(load, blob)
            await engine.push_weight_bucket(list(state.items()))
        except (KeyError, ValueError) as e:
            await engine.abort_weight_update()
            return bad(f"weight update rejected: {e}")
        except RuntimeError as e:
            return bad(str(e), 409)
        return web.json_response({"status": "ok", "bytes": len(blob)})

    async def finish_update(request: web.Request) -> web.Response:
        try:
            version = int(request.query["version"])
        except (KeyError, ValueError):
            return bad("query parameter 'version' (int) is required")
        try:
            await engine.finish_weight_update(version)
        except RuntimeError as e:
            return bad(str(e), 409)
        return web.json_response({"status": "ok", "weight_version": str(version)})

    async def abort_update(_: web.Request) -> web.Response:
        await engine.abort_weight_update()
        return web.json_response({"status": "aborted"})

    async def no_nccl(request: web.Request) -> web.Response:
        return bad(f"{request.path}: NCCL weight transfer is not available on this server; "
                   f"use /sao/update_weights", 501)

    app = web.Application(client_max_size=16 * 1024**3)  # weight blobs
    app.router.add_get("/health", health)
    app.router.add_get("/weight_info", weight_info)
    app.router.add_get("/sao/info", info)
    app.router.add_post("/inference/v1/generate", generate_tokens)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/pause", pause)
    app.router.add_post("/resume", resume)
    app.router.add_post("/sao/start_weight_update", start_update)
    app.router.add_post("/sao/update_weights", update_weights)
    app.router.add_post("/sao/finish_weight_update", finish_update)
    app.router.add_post("/sao/abort_weight_update", abort_update)
    for route in ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update"):
        app.router.add_post(route, no_nccl)
    return app


async def start_server(engine: RolloutEngine, host: str = "127.0.0.1", port: int = 0):
    """Start serving in the running loop; return (runner, bound port). ``await runner.cleanup()`` to stop."""
    from aiohttp import web

    runner = web.AppRunner(build_app(engine))
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, bound


async def serve_forever(cfg: EngineConfig, host: str, port: int) -> None:
    """Build the engine ``cfg`` describes and serve it until cancelled."""
    engine = make_engine(cfg)
    runner, bound = await start_server(engine, host, port)
    print(f"rollout server ({cfg.backend}) for {cfg.model_path} on http://{host}:{bound}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await engine.close()


def main(argv: list[str] | None = None) -> None:
    """``python -m megatron_sao.rollout.engines.http_server --model DIR``: serve without a project config."""
    parser = argparse.ArgumentParser(description="Serve an HF-engine rollout server (CPU).")
    parser.add_argument("--model", required=True, help="HF model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--inflight-policy", default="keep", choices=["keep", "abort"])
    args = parser.parse_args(argv)
    cfg = EngineConfig(backend="hf", model_path=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                       inflight_policy=args.inflight_policy)
    asyncio.run(serve_forever(cfg, args.host, args.port))


if __name__ == "__main__":
    main()
