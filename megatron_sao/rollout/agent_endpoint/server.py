"""The OpenAI-compatible HTTP endpoint any agent harness drives the policy through.

Routes (aiohttp, on the episode driver's event loop, so a request reaches the episode's engine without
a thread hop):

* ``GET /v1/models`` and ``GET /sessions/<key>/v1/models``: the one model, ``model_name``;
* ``POST /v1/chat/completions`` (the key as ``Authorization: Bearer <key>``) and
  ``POST /sessions/<key>/v1/chat/completions``: one assistant turn of that episode
  (agent_endpoint/session.py), streamed as server-sent events when ``stream`` is true;
* ``GET /health``.

Each episode gets its own key, so a harness is pointed at a run with a base URL
(``.../sessions/<key>/v1``) or with the plain ``/v1`` URL and the key as its API key; nothing else of
the harness changes. Errors use OpenAI's shape ``{"error": {"message", "type", "code"}}``: 400 for a
request the endpoint refuses (naming the field) and for a loop limit (code
``context_length_exceeded``), 401 without a key, 404 for an unknown or finished episode (clients do not
retry it: a harness whose episode was stopped stops), 503 when the engine failed (the episode is re-run
elsewhere by the driver).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from aiohttp import web

from megatron_sao.envs.base import ModelEndpoint
from megatron_sao.rollout.agent_endpoint.messages import RequestError
from megatron_sao.rollout.agent_endpoint.session import EndpointSession, LimitReached, SessionClosed
from megatron_sao.rollout.agent_endpoint.tools import ToolFormat
from megatron_sao.rollout.turns import AgentLoopConfig, EngineActivity, EngineCallError

logger = logging.getLogger(__name__)


def _error(status: int, message: str, kind: str, code: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": code}},
                             status=status)


class AgentEndpoint:
    """The endpoint of one run (module docstring). Start it on the loop the episodes run on."""

    def __init__(self, formatter: Any, *, host: str = "127.0.0.1", port: int = 0, model_name: str = "policy",
                 public_host: str | None = None, turn_log: str | os.PathLike | None = None) -> None:
        self.formatter, self.host, self.port, self.model_name = formatter, host, port, model_name
        self.public_host = public_host or host
        # One JSON line per assistant turn as the engine returned it (ids, log-probs, versions), to audit
        # the trajectories against (rollout.agent_endpoint.log_turns).
        self.turn_log = Path(turn_log) if turn_log else None
        self._log = None
        self.tool_format = ToolFormat(formatter)
        self.sessions: dict[str, EndpointSession] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._runner: web.AppRunner | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        app = web.Application(client_max_size=256 << 20)  # a 128K-token history with tool output is MBs
        app.add_routes([
            web.get("/health", self._health),
            web.get("/v1/models", self._models), web.get("/sessions/{key}/v1/models", self._models),
            web.post("/v1/chat/completions", self._chat), web.post("/sessions/{key}/v1/chat/completions", self._chat),
        ])
        if self.turn_log is not None:
            self.turn_log.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.turn_log, "a", encoding="utf-8")
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        logger.info("agent endpoint serving on %s", self.url)

    async def stop(self) -> None:
        for s in self.sessions.values():
            s.closed = True
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._log is not None:
            self._log.close()
            self._log = None

    @property
    def url(self) -> str:
        return f"http://{self.public_host}:{self.port}"

    # ------------------------------------------------------------------ episodes
    def open_session(self, engine: Any, cfg: AgentLoopConfig, *, prompt_id: str, env: str,
                     activity: EngineActivity | None = None) -> EndpointSession:
        if self._runner is None:
            raise RuntimeError("the agent endpoint is not started")
        s = EndpointSession(engine, self.formatter, self.tool_format, cfg, prompt_id=prompt_id, env=env,
                            activity=activity, on_turn=self._log_turn if self._log is not None else None)
        self.sessions[s.key] = s
        self._locks[s.key] = asyncio.Lock()
        return s

    def close_session(self, session: EndpointSession) -> None:
        session.closed = True
        self.sessions.pop(session.key, None)
        self._locks.pop(session.key, None)

    def model_endpoint(self, session: EndpointSession, stop=None) -> ModelEndpoint:
        """What the harness is given: the episode's base URL, its key, the model's name."""
        return ModelEndpoint(base_url=f"{self.url}/sessions/{session.key}/v1", api_key=session.key,
                             model=self.model_name, stop=stop)

    def _log_turn(self, session: EndpointSession, record: Any) -> None:
        self._log.write(json.dumps({"episode": session.episode_id, "prompt_id": session.prompt_id,
                                    **dataclasses.asdict(record)}) + "\n")
        self._log.flush()

    # ------------------------------------------------------------------ routes
    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "sessions": len(self.sessions)})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "megatron-sao"}]})

    def _key(self, request: web.Request) -> str | None:
        key = request.match_info.get("key")
        if key:
            return key
        auth = request.headers.get("Authorization", "")
        return auth[7:].strip() if auth.startswith("Bearer ") else None

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        key = self._key(request)
        if not key:
            return _error(401, "no episode key: use the episode's base URL or its key as the API key",
                          "authentication_error")
        session = self.sessions.get(key)
        if session is None:
            return _error(404, "no running episode has this key (it ended, or never existed)", "not_found_error")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        try:
            async with self._locks.get(key) or asyncio.Lock():  # one turn at a time per episode
                response = await session.chat(body)
        except RequestError as e:
            return _error(400, str(e), "invalid_request_error")
        except LimitReached as e:
            return _error(400, str(e), "invalid_request_error", "context_length_exceeded")
        except SessionClosed as e:
            return _error(404, str(e), "not_found_error")
        except EngineCallError as e:
            return _error(503, f"the rollout engine failed: {e}", "server_error")
        if body.get("stream"):
            return await self._stream(request, response, bool((body.get("stream_options") or {}).get("include_usage")))
        return web.json_response(response)

    async def _stream(self, request: web.Request, response: dict, usage: bool) -> web.StreamResponse:
        """The finished turn as chat.completion.chunk events: role and content, the tool calls, the finish."""
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)
        choice = response["choices"][0]
        msg = choice["message"]
        base = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
                "model": response["model"]}
        deltas = [{"role": "assistant", "content": msg.get("content") or ""}]
        if msg.get("tool_calls"):
            deltas.append({"tool_calls": [{"index": i, **c} for i, c in enumerate(msg["tool_calls"])]})
        events = [{**base, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
        events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]})
        if usage:
            events.append({**base, "choices": [], "usage": response["usage"]})
        for ev in events:
            await out.write(f"data: {json.dumps(ev)}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out
