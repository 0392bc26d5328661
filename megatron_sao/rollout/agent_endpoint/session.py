"""One episode behind the agent endpoint: a harness's chat requests in, the episode's trajectories out.

The session holds the conversation as token ids, built by appending (the agent loop's rule,
rollout/chat.py), and the canonical messages those ids stand for. A request is matched at the message
level (agent_endpoint/messages.py):

* the messages recorded so far, unchanged, plus new non-assistant messages (tool results, a user turn):
  the recorded ids are reused as they are -- the model's own turns are never re-tokenised -- and the new
  messages are appended as observation ids (the template's render diff after the assistant turn);
* anything else -- the harness truncated, edited or summarised the history, or dropped the last turn --
  starts a new *segment*: the request's whole history is rendered afresh and recorded as observation
  (none of it is an action of this segment: the model's earlier turns appear there only as the harness
  rewrote them), and generation goes on from there. ``info["segment_start"]`` says why.

Each segment becomes one trajectory, since the learner must score every action in the context it was
sampled in and a row is one causal context. All of them carry ``info["episode"]``, ``info["segment"]``
and ``info["segments"]``; the last one ends the episode (the grader's reward, terminal); an earlier one
is ``truncated`` with ``bootstrap`` = that reward (reward 0 on its own tokens): with the reward only at
the end and no discount, the return from any of its states is the episode's reward. A segment with no
assistant turn is dropped (nothing to train; counted in ``info["empty_segments"]``).

Every assistant turn is one generate call on the episode's pinned engine with the run's sampling
(temperature, top-p, stop ids: DIS divides by the sampler's log-probs, so a harness's ``temperature`` or
``stop`` is ignored and counted in ``info["ignored_request_fields"]``; ``max_tokens`` may only lower the
turn's budget). The sampled ids, log-probs, versions and -- under routing replay -- routes go into the
segment's builder exactly as the engine returned them.

Limits: ``max_turns`` over the episode and ``max_total_tokens`` per segment (a trajectory is one row of
``model.max_seq_len``). The turn that reaches one is answered; a further request gets ``LimitReached``
(HTTP 400 ``context_length_exceeded``, which litellm and OpenAI clients raise as a context-window error,
and mini-swe-agent stops on), and the episode ends ``truncated`` with bootstrap 0: the environment still
grades the final state, and no later state exists. A harness that stops by itself at the limit ends
``terminated``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from megatron_sao.rollout.agent_endpoint.messages import RequestError, canonical_messages, continues
from megatron_sao.rollout.agent_endpoint.tools import ToolFormat
from megatron_sao.rollout.turns import (
    AgentLoopConfig,
    EngineActivity,
    EngineCallError,
    add_turn_routes,
    generate_turn,
    turn_seed,
)
from megatron_sao.trajectory import Trajectory, TrajectoryBuilder

# Request fields the run's sampling overrides (DIS needs the sampler's own distribution), or that change
# nothing the endpoint returns; anything else unknown is refused by name.
_IGNORED = {"temperature", "top_p", "stop", "frequency_penalty", "presence_penalty", "seed", "user", "metadata",
            "parallel_tool_calls", "tool_choice", "logprobs", "top_logprobs", "store", "stream_options",
            "reasoning_effort", "service_tier", "drop_params", "response_format"}
_KNOWN = {"model", "messages", "tools", "stream", "n", "max_tokens", "max_completion_tokens", *_IGNORED}


class LimitReached(Exception):
    """The episode hit a limit of the loop (``max_turns``, ``max_total_tokens``): no further turn."""


class SessionClosed(Exception):
    """The episode is over (ended, or its engine failed): requests are refused."""


@dataclass
class _Segment:
    builder: TrajectoryBuilder
    messages: list[dict]  # canonical messages the ids hold (ending with an assistant turn once one ran)
    start: str  # "prompt" (the first) or why it began ("rewritten_history")
    last_action: list[int] | None = None  # ids of the last assistant turn (None: ids end with a prompt)
    turns: int = 0


@dataclass
class TurnRecord:
    """What one generate call returned, as the engine returned it (for tests and benchmarks)."""

    segment: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str


@dataclass
class SessionStats:
    turns: int = 0
    rewrites: int = 0
    ignored_request_fields: dict[str, int] = field(default_factory=dict)
    generate_s: float = 0.0
    request_s: float = 0.0  # wall time of whole requests (prompt building + generation)


class EndpointSession:
    """The token state of one harness episode (module docstring)."""

    def __init__(self, engine: Any, formatter: Any, tool_format: ToolFormat, cfg: AgentLoopConfig, *,
                 prompt_id: str, env: str, activity: EngineActivity | None = None, key: str | None = None,
                 on_turn: Callable[[EndpointSession, TurnRecord], None] | None = None) -> None:
        self.engine, self.formatter, self.tool_format, self.cfg = engine, formatter, tool_format, cfg
        self.prompt_id, self.env, self.activity, self.on_turn = prompt_id, env, activity, on_turn
        self.key = key or uuid.uuid4().hex
        self.episode_id = uuid.uuid4().hex
        self.segments: list[_Segment] = []
        self.records: list[TurnRecord] = []
        self.stats = SessionStats()
        self.limit: str | None = None  # the loop limit that refused a turn: the episode was cut there
        self._exhausted: str | None = None  # a limit the last turn reached (the next request is refused)
        self.error: BaseException | None = None  # the engine failed: the episode fails (and may re-run)
        self.closed = False
        self.failed = asyncio.Event()  # set with `error`: the episode stops waiting for its harness
        self._abort_info = {"abort_retries": 0}
        self._stop_ids = tuple(dict.fromkeys(cfg.sampling.stop_token_ids + formatter.stop_token_ids))

    # ------------------------------------------------------------------ one request
    async def chat(self, body: dict) -> dict:
        """Answer one chat-completions request body (not streamed) with the OpenAI response object."""
        t0 = time.monotonic()
        if self.closed or self.error is not None:
            raise SessionClosed(f"episode {self.prompt_id!r} is over" + (f" (engine error: {self.error})"
                                                                          if self.error is not None else ""))
        unknown = sorted(set(body) - _KNOWN)
        if unknown:
            raise RequestError(f"unsupported request fields {unknown}")
        if body.get("n") not in (None, 1):
            raise RequestError("n must be 1 (one sample per turn: single rollout)")
        for name in sorted(_IGNORED & set(body)):
            self.stats.ignored_request_fields[name] = self.stats.ignored_request_fields.get(name, 0) + 1
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise RequestError("tools must be a list")
        messages = canonical_messages(body.get("messages"))
        if self._exhausted is not None:
            self.limit = self._exhausted
        if self.limit is not None:
            raise LimitReached(self._limit_message())
        seg = self._extend_or_fork(messages, tools)
        b = seg.builder
        room = self.cfg.max_total_tokens - len(b)
        if room < 1:
            self.limit = "max_total_tokens"
            raise LimitReached(self._limit_message())
        budget = min(self.cfg.max_new_tokens_per_turn, room)
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        if asked is not None:
            if not isinstance(asked, int) or asked < 1:
                raise RequestError("max_tokens must be an int >= 1")
            budget = min(budget, asked)
        result = await self._generate(b, budget)
        if self.cfg.return_routes:
            add_turn_routes(b, result, len(b))
        b.add_action(result.token_ids, result.logprobs, result.versions)
        seg.turns += 1
        self.stats.turns += 1
        seg.last_action = list(result.token_ids)
        record = TurnRecord(len(self.segments) - 1, list(result.token_ids), list(result.logprobs),
                            list(result.versions), result.finish_reason)
        self.records.append(record)
        if self.on_turn is not None:
            self.on_turn(self, record)
        content, calls = self.tool_format.parse(self.formatter.action_text(result.token_ids))
        message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
        if calls:
            message["tool_calls"] = calls
        seg.messages = messages + [canonical_messages([message])[0]]
        if result.finish_reason == "length" and len(b) >= self.cfg.max_total_tokens:
            self._exhausted = "max_total_tokens"  # the episode is cut if the harness asks for another turn
        elif self.stats.turns >= self.cfg.max_turns:
            self._exhausted = "max_turns"
        finish = "tool_calls" if calls else ("length" if result.finish_reason == "length" else "stop")
        self.stats.request_s += time.monotonic() - t0
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model") or "policy",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": len(b) - len(result.token_ids), "completion_tokens": len(result.token_ids),
                      "total_tokens": len(b)},
        }

    def _extend_or_fork(self, messages: list[dict], tools: list[dict] | None) -> _Segment:
        seg = self.segments[-1] if self.segments else None
        tail = continues(seg.messages, messages) if seg is not None and seg.last_action is not None else None
        if tail is not None:
            ids = self.formatter.continuation_ids(self.tool_format.continuation(tail), seg.last_action)
            seg.builder.add_observation(ids)
            seg.messages = messages
            return seg
        rendered, extra = self.tool_format.template_messages(messages, tools)
        ids = self.formatter.prompt_ids(rendered, **extra)
        b = TrajectoryBuilder(prompt_id=self.prompt_id, env=self.env)
        b.timings.update(generate_s=0.0)
        if seg is None:
            b.add_prompt(ids)
            new = _Segment(b, messages, "prompt")
        else:  # the harness rewrote the history: none of it is an action of the new segment
            b.add_observation(ids)
            new = _Segment(b, messages, "rewritten_history")
            self.stats.rewrites += 1
        self.segments.append(new)
        return new

    async def _generate(self, b: TrajectoryBuilder, budget: int):
        sampling = dataclasses.replace(
            self.cfg.sampling, max_new_tokens=budget, stop_token_ids=self._stop_ids,
            seed=turn_seed(self.cfg.sampling.seed, self.prompt_id, self.stats.turns),
            return_routes=self.cfg.return_routes, routes_start=b.routes_covered)
        t0 = time.monotonic()
        try:
            return await generate_turn(self.engine, b.tokens, sampling, self.cfg, self._abort_info, b.timings,
                                       self.activity)
        except EngineCallError as e:
            self.error = e
            self.failed.set()
            raise
        finally:
            self.stats.generate_s += time.monotonic() - t0

    def _limit_message(self) -> str:
        what = (f"{self.cfg.max_turns} turns (rollout.max_turns)" if self.limit == "max_turns" else
                f"{self.cfg.max_total_tokens} tokens (rollout.max_total_tokens)")
        return f"This model's maximum context length is reached: the episode used its {what}."

    # ------------------------------------------------------------------ the episode's end
    def finish(self, reward: float, info: dict | None = None) -> list[Trajectory]:
        """The episode's trajectories once the environment graded it (module docstring). Raises
        ValueError when no assistant turn was recorded (the caller makes that a failed trajectory)."""
        self.closed = True
        kept = [s for s in self.segments if s.turns > 0]
        if not kept:
            raise ValueError("the harness made no chat request that reached the model")
        base = {**(info or {}), **self.info(), "episode": self.episode_id, "segments": len(kept),
                "empty_segments": len(self.segments) - len(kept)}
        out = []
        for k, seg in enumerate(kept):
            seg_info = {**base, "segment": k, "segment_start": seg.start, "turns_in_segment": seg.turns}
            if k < len(kept) - 1:
                seg_info["end_reason"] = "history_rewritten"
                out.append(seg.builder.finish("truncated", reward=0.0, bootstrap=float(reward), info=seg_info))
            elif self.limit is not None:
                seg_info["end_reason"] = self.limit
                out.append(seg.builder.finish("truncated", reward=float(reward), bootstrap=0.0, info=seg_info))
            else:
                seg_info.setdefault("end_reason", "harness_done")
                out.append(seg.builder.finish("terminated", reward=float(reward), info=seg_info))
        return out

    def info(self) -> dict:
        return {"turns": self.stats.turns, "rewrites": self.stats.rewrites, **self._abort_info,
                "ignored_request_fields": dict(self.stats.ignored_request_fields),
                "finish_reasons": [r.finish_reason for r in self.records]}
