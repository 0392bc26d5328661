"""The agent loop's calls into an environment, bounded and watched.

An environment's `reset` or `step` (a tool that runs model-written code, queries a service, ...) may
never return. Unbounded, such an episode held its concurrency slot for good, no trajectory arrived, and
after `rollout.timeout_s` the trainer stopped with "rollout engine: no batch ..." -- blaming the engine,
naming neither the environment nor the call. Here every call is bounded (`AgentLoopConfig.env_timeout_s`,
the trainer sets rollout.timeout_s): past it the episode fails with an `EnvTimeoutError` naming the
environment, the call and the tool call it was given; and `EnvCalls` knows which calls are in progress
and for how long, so a batch wait that runs out can say which environment it is waiting on.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable
from typing import Any

_SHOWN = 200  # characters of an action shown in a message


class EnvTimeoutError(TimeoutError):
    """An environment call did not return within the agent loop's bound."""


def describe_call(what: str, action_text: str | None = None) -> str:
    """`what` (reset() / step() / close()) and, for a step, the tool call(s) of its action, short;
    else the action's end."""
    if action_text is None:
        return what
    from megatron_sao.envs.tool_calls import parse_tool_calls

    calls = [c for c in parse_tool_calls(action_text) if c.ok]
    if calls:
        text = "; ".join(f"{c.name}({c.arguments})" for c in calls)
        return f"{what} of tool call {text[:_SHOWN]!r}" + (" ..." if len(text) > _SHOWN else "")
    return f"{what} of the action ending {action_text[-_SHOWN:]!r}"


class EnvCalls:
    """Environment calls in progress (one event loop: no locks), for the trainer's stall report."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self.running: dict[int, tuple[str, str, float]] = {}  # id -> (env, call, start)

    def oldest(self) -> tuple[str, str, float] | None:
        """(environment, call, seconds so far) of the call in progress the longest, or None. Safe from
        another thread: the values are copied in one C call, which another thread cannot interleave."""
        running = tuple(self.running.values())
        if not running:
            return None
        env, call, t0 = min(running, key=lambda r: r[2])
        return env, call, time.monotonic() - t0

    def describe_oldest(self) -> str:
        """A sentence for a stopped batch wait, or "" when no environment call is in progress."""
        oldest = self.oldest()
        if oldest is None:
            return ""
        env, call, seconds = oldest
        return (f"{len(self.running)} episode(s) wait on their environment; the longest, for {seconds:.0f}s, on "
                f"environment {env!r}: {call}")


async def call_env(awaitable: Awaitable[Any], env: str, what: str, timeout_s: float | None, calls: EnvCalls | None,
                   action_text: str | None = None) -> Any:
    """Await `env`'s `what` (reset() / step() of `action_text` / close()); EnvTimeoutError past `timeout_s`."""
    described = describe_call(what, action_text)
    key = next(calls._ids) if calls is not None else None
    if calls is not None:
        calls.running[key] = (env, described, time.monotonic())
    bound = asyncio.timeout(timeout_s)
    try:
        async with bound:
            return await awaitable
    except TimeoutError:
        if not bound.expired():  # the environment's own TimeoutError (a socket, a subprocess): its error
            raise
        raise EnvTimeoutError(f"environment {env!r} did not return within {timeout_s:g}s (rollout.timeout_s) "
                              f"from {described}") from None
    finally:
        if calls is not None:
            calls.running.pop(key, None)
