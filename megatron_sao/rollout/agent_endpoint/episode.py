"""One episode of a harness environment: its agent drives the policy through the endpoint.

The episode's engine is the one the driver pinned (every turn on one server, as in the agent loop). The
environment gets an ``envs.base.ModelEndpoint`` (this episode's base URL and key) and runs its harness;
the harness's requests become turns of the episode's session (agent_endpoint/session.py); when the agent
stops, the environment grades the result with its own grader and returns the reward.

How it ends:

* the environment returned a ``HarnessOutcome``: the session's trajectories (one per segment), with the
  environment's reward and ``info["harness"]`` (what the environment said);
* the engine failed on a turn: the harness is stopped at once (the session answers 404 from then on,
  so its client does not retry) and the episode is one failed trajectory with ``end_reason
  "engine_error"``: the driver checks the server and re-runs the episode elsewhere, as for the agent loop;
* the environment raised, or the harness never reached the model: one failed trajectory, ``"error"``.

The session is closed and the environment closed (its harness stopped, its sandbox removed) whatever
happened, a cancelled episode included.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from megatron_sao.envs.base import Task
from megatron_sao.rollout.turns import AgentLoopConfig, EngineActivity
from megatron_sao.trajectory import Trajectory, TrajectoryBuilder


def _failed(task: Task, session: Any, pad_id: int, error: str, end_reason: str, info: dict) -> Trajectory:
    seg = session.segments[-1].builder if session.segments else None
    b = seg if seg is not None and len(seg) else TrajectoryBuilder(prompt_id=task.prompt_id, env=task.env)
    if not len(b):
        b.add_prompt([pad_id])  # the contract needs T >= 1
        info["placeholder_tokens"] = True
    return b.finish("failed", error=error, info={**info, **session.info(), "end_reason": end_reason})


async def run_harness_episode(engine: Any, env: Any, task: Task, endpoint: Any, cfg: AgentLoopConfig, *,
                              activity: EngineActivity | None = None) -> list[Trajectory]:
    session = endpoint.open_session(engine, cfg, prompt_id=task.prompt_id, env=task.env, activity=activity)
    pad_id = endpoint.formatter.pad_token_id
    t0 = time.monotonic()
    info: dict[str, Any] = {"harness_env": getattr(env, "name", type(env).__name__)}
    harness = asyncio.ensure_future(env.run_harness(task, endpoint.model_endpoint(
        session, stop=lambda: endpoint.close_session(session))))
    engine_failed = asyncio.ensure_future(session.failed.wait())
    trajs: list[Trajectory] = []
    try:
        await asyncio.wait({harness, engine_failed}, return_when=asyncio.FIRST_COMPLETED)
        trajs = _result(task, session, harness, pad_id, info, t0)
    finally:
        endpoint.close_session(session)
        engine_failed.cancel()
        if not harness.done():
            harness.cancel()
        await asyncio.gather(harness, engine_failed, return_exceptions=True)
        try:
            await env.close()
        except Exception as e:  # the data is valid; record and go on
            for t in trajs:
                t.info["close_error"] = f"{type(e).__name__}: {e}"
    return trajs


def _result(task: Task, session: Any, harness: asyncio.Future, pad_id: int, info: dict, t0: float) -> list[Trajectory]:
    # The engine failed on a turn: the harness stops, the driver re-runs the episode. This wins even when the
    # harness has returned too (it saw the 503 and gave up before the wait woke): its grade is of a cut episode.
    if session.error is not None or not harness.done():
        return [_failed(task, session, pad_id, str(session.error), "engine_error", info)]
    try:
        outcome = harness.result()
    except Exception as e:  # the environment's failure ends only this episode
        return [_failed(task, session, pad_id, f"{type(e).__name__}: {e}", "error", info)]
    info["harness"] = dict(outcome.info)
    info["harness_s"] = time.monotonic() - t0
    try:
        trajs = session.finish(float(outcome.reward), info)
    except ValueError as e:
        return [_failed(task, session, pad_id, str(e), "error", info)]
    for t in trajs:
        t.timings["harness_s"] = info["harness_s"]
    return trajs
