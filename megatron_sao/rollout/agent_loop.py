"""The multi-turn agent loop: one task -> one trajectory, many in flight, each handed over at once.

``run_episode`` plays one episode: sample an action from the rollout engine, decode it to text for the
environment, append the environment's reply as observation ids, repeat. The trajectory is built by
appending ids (``ChatFormatter``, no re-tokenization): sampled ids exactly as sampled, the stop token
included with its log-prob and per-token policy versions; observation ids with no log-prob.

How an episode ends (``info["end_reason"]``):

* ``env_done``: the environment said done -> ``terminated`` with the environment's reward.
* ``env_truncated``: it said done with ``info["truncated"]`` (its own tool-call limit) -> ``truncated``
  with the environment's reward and ``bootstrap=0.0``: the environment accepts no further action and
  gives no observation, so no later state exists to value; the end is terminal for the return.
* ``max_turns`` / ``max_total_tokens``: a limit of the loop cut the episode -> ``truncated``, reward 0,
  and the trainer bootstraps from the critic (``bootstrap="critic"``, the value at the last position).
  That position must be a state the critic is trained on, i.e. one that precedes a sampled token:
  - cut inside an action (the token budget ran out while sampling): the last token is mid-action;
  - cut after a stop token (``max_turns``, or the observation leaves no room for another action):
    the environment's observation is appended when it fits in ``max_total_tokens``, so the last
    position is "before the next action's first token", the value the skip-observation GAE pairs
    with that token. A stop-token state itself is never a target (an observation always follows it).
    When the observation does not fit, the trajectory ends with the stop token and bootstraps from
    the value of the state that token was sampled in (``bootstrap="critic_before_stop"``,
    ``info["bootstrap"] = "no_room_for_observation"``): a trained state, and with the stop token's
    reward 0 the return there is that value, as for any cut episode, not the 0 of a failure.
* ``error``: the environment (or anything but the engine call) raised -> ``failed``, reward 0, ``error`` =
  type + message; ``env_timeout``: an environment call did not return within ``env_timeout_s`` (the
  error names the environment and the tool call; rollout/env_calls.py); ``engine_error``: the engine's
  generate raised (a dead or unreachable server). A
  failure ends only its own episode; the trainer counts failed trajectories and never trains on them,
  and the driver re-runs an ``engine_error`` episode on another server if its server is unhealthy.

A turn cut by ``max_new_tokens_per_turn`` with budget left is not the end: the template's closing
is appended with the observation (``ChatFormatter.closing_for``) and the environment judges the cut
text. A fixed ``sampling.seed`` becomes a distinct seed per (prompt, turn), else every episode would
share one noise stream.

Abort policy: with ``EngineConfig.inflight_policy="abort"`` a weight update ends in-flight requests
with ``finish_reason="abort"``. The loop then drops that turn's partial tokens and re-generates the
turn from the same prefix (the new weights sample the whole turn, so a turn never mixes versions);
re-tries are counted in ``info["abort_retries"]`` and capped by ``max_abort_retries``.

``run_many`` runs a fixed list of tasks with bounded concurrency (evaluation, value pretraining);
the trainer's long-running producer, with admission control, is ``rollout/episode_driver.py``.
Both hand each trajectory to ``on_done`` as soon as it finishes (single rollout: no grouping, so a
slow episode never holds back a fast one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from megatron_sao.envs.base import Environment, Task, is_harness
from megatron_sao.rollout.agent_endpoint.episode import run_harness_episode
from megatron_sao.rollout.chat import ChatFormatter
from megatron_sao.rollout.engines.protocol import RolloutEngine
from megatron_sao.rollout.env_calls import EnvTimeoutError, call_env
from megatron_sao.rollout.turns import (
    AgentLoopConfig,
    EngineActivity,
    EngineCallError,
    add_turn_routes,
    generate_turn,
    turn_seed,
)
from megatron_sao.trajectory import Trajectory, TrajectoryBuilder

EnvFactory = Callable[[Task], "Environment | Awaitable[Environment]"]
OnDone = Callable[[Trajectory], "None | Awaitable[None]"]


async def _maybe_await(x: Any) -> Any:
    return await x if inspect.isawaitable(x) else x


async def run_episode(engine: RolloutEngine, env: Environment, task: Task, formatter: ChatFormatter,
                      cfg: AgentLoopConfig, *, activity: EngineActivity | None = None) -> Trajectory:
    """Play one episode of ``task`` in ``env`` and return its trajectory (never raises for env/engine errors).

    The environment is closed at the end. ``asyncio.CancelledError`` propagates (a stopped driver).
    """
    b = TrajectoryBuilder(prompt_id=task.prompt_id, env=task.env)
    b.timings.update(generate_s=0.0, env_s=0.0)
    info: dict[str, Any] = {"turns": 0, "abort_retries": 0, "finish_reasons": []}
    stop_ids = tuple(dict.fromkeys(cfg.sampling.stop_token_ids + formatter.stop_token_ids))
    status, reward, error, bootstrap = "failed", 0.0, None, None
    calls = activity.env_calls if activity is not None else None
    try:
        t0 = time.monotonic()
        await call_env(env.reset(task), task.env, "reset()", cfg.env_timeout_s, calls)
        b.timings["env_s"] += time.monotonic() - t0
        prompt = formatter.prompt_ids(task.messages)
        b.add_prompt(prompt)
        if len(prompt) >= cfg.max_total_tokens:
            raise ValueError(f"prompt has {len(prompt)} tokens, max_total_tokens={cfg.max_total_tokens} "
                             "leaves no room for an action")
        while True:
            budget = min(cfg.max_new_tokens_per_turn, cfg.max_total_tokens - len(b))
            sampling = dataclasses.replace(cfg.sampling, max_new_tokens=budget, stop_token_ids=stop_ids,
                                           seed=turn_seed(cfg.sampling.seed, task.prompt_id, info["turns"]),
                                           return_routes=cfg.return_routes, routes_start=b.routes_covered)
            result = await generate_turn(engine, b.tokens, sampling, cfg, info, b.timings, activity)
            if cfg.return_routes:
                add_turn_routes(b, result, len(b))
            b.add_action(result.token_ids, result.logprobs, result.versions)
            info["turns"] += 1
            info["finish_reasons"].append(result.finish_reason)
            if result.finish_reason == "length" and len(b) >= cfg.max_total_tokens:  # cut by the total budget
                status, bootstrap, info["end_reason"] = "truncated", "critic", "max_total_tokens"  # mid-action
                break
            t0 = time.monotonic()
            action = formatter.action_text(result.token_ids)
            step = await call_env(env.step(action), task.env, "step()", cfg.env_timeout_s, calls, action)
            b.timings["env_s"] += time.monotonic() - t0
            if step.info:
                info["env_info"] = dict(step.info)
            if step.done:
                reward = float(step.reward)
                if step.info.get("truncated"):  # terminal for the return: see the module docstring
                    status, bootstrap, info["end_reason"] = "truncated", 0.0, "env_truncated"
                else:
                    status, info["end_reason"] = "terminated", "env_done"
                break
            if step.observation is None:
                raise ValueError(f"environment {task.env!r} returned done=False with observation=None")
            obs = formatter.observation_ids(cfg.observation_role, step.observation, result.token_ids)
            out_of_turns = info["turns"] >= cfg.max_turns
            if out_of_turns or len(b) + len(obs) >= cfg.max_total_tokens:  # no next action
                status, info["end_reason"] = "truncated", "max_turns" if out_of_turns else "max_total_tokens"
                if len(b) + len(obs) <= cfg.max_total_tokens:  # end before the next action: a trained state
                    b.add_observation(obs)
                    bootstrap = "critic"
                else:
                    bootstrap, info["bootstrap"] = "critic_before_stop", "no_room_for_observation"
                break
            b.add_observation(obs)
    except Exception as e:  # an episode's failure must never stop the others
        engine_side = isinstance(e, EngineCallError)  # its message already names the engine's exception
        status, reward, error = "failed", 0.0, str(e) if engine_side else f"{type(e).__name__}: {e}"
        info["end_reason"] = "engine_error" if engine_side else "env_timeout" if isinstance(e, EnvTimeoutError) \
            else "error"
    finally:
        try:
            await call_env(env.close(), task.env, "close()", cfg.env_timeout_s, calls)
        except Exception as e:  # the data is valid; record and go on
            info["close_error"] = f"{type(e).__name__}: {e}"
    if status == "failed" and len(b) == 0:
        # The contract needs T >= 1; a placeholder pad token keeps the failure visible and countable.
        b.add_prompt([formatter.pad_token_id])
        info["placeholder_tokens"] = True
    return b.finish(status, reward=reward, bootstrap=bootstrap if status == "truncated" else None,
                    error=error, info=info)


def failed_placeholder(task: Task, formatter: ChatFormatter, error: str) -> Trajectory:
    """A failed trajectory for an episode that produced no tokens (the contract needs T >= 1)."""
    b = TrajectoryBuilder(prompt_id=task.prompt_id, env=task.env)
    b.add_prompt([formatter.pad_token_id])
    return b.finish("failed", error=error, info={"end_reason": "error", "placeholder_tokens": True, "turns": 0})


async def run_unit(engine: RolloutEngine, env_factory: EnvFactory, task: Task, formatter: ChatFormatter,
                   cfg: AgentLoopConfig, *, activity: EngineActivity | None = None,
                   endpoint: Any = None) -> list[Trajectory]:
    """Create the task's environment and run its episode: the agent loop's one trajectory, or, for an
    environment that runs its own agent harness (``envs.base.HarnessEnvironment``), the harness's episode
    through ``endpoint`` (``rollout/agent_endpoint/``): one trajectory per segment, the last one ending
    the episode. A factory error gives a failed trajectory."""
    try:
        env = await _maybe_await(env_factory(task))
    except Exception as e:  # e.g. an unknown env name: this task fails, the others run
        return [failed_placeholder(task, formatter, f"{type(e).__name__}: {e}")]
    if is_harness(env):
        if endpoint is None:
            await env.close()
            return [failed_placeholder(task, formatter, f"environment {task.env!r} runs an agent harness and needs "
                                                        "the agent endpoint (rollout.agent_endpoint)")]
        return await run_harness_episode(engine, env, task, endpoint, cfg, activity=activity)
    return [await run_episode(engine, env, task, formatter, cfg, activity=activity)]


async def run_one(engine: RolloutEngine, env_factory: EnvFactory, task: Task, formatter: ChatFormatter,
                  cfg: AgentLoopConfig, *, activity: EngineActivity | None = None, endpoint: Any = None) -> Trajectory:
    """``run_unit``'s episode as one trajectory: the one that ends it (evaluation: one result per task)."""
    return (await run_unit(engine, env_factory, task, formatter, cfg, activity=activity, endpoint=endpoint))[-1]


async def run_many(engine: RolloutEngine, env_factory: EnvFactory, tasks: Sequence[Task], formatter: ChatFormatter,
                   cfg: AgentLoopConfig, on_done: OnDone | None = None, endpoint: Any = None) -> list[Trajectory]:
    """Run every task, at most ``cfg.max_concurrency`` at once; one environment per task.

    ``on_done(traj)`` (sync or async) is called for each trajectory the moment it finishes, in finish
    order. The returned list is in task order. An exception raised by ``on_done`` is a consumer bug:
    it cancels the remaining episodes and propagates. A harness environment's episode counts as the
    trajectory that ends it (``run_one``); ``endpoint`` serves its harness.
    """
    sem = asyncio.Semaphore(cfg.max_concurrency)
    out: list[Trajectory | None] = [None] * len(tasks)

    async def one(i: int, task: Task) -> None:
        async with sem:
            traj = await run_one(engine, env_factory, task, formatter, cfg, endpoint=endpoint)
        out[i] = traj
        if on_done is not None:
            await _maybe_await(on_done(traj))

    async with asyncio.TaskGroup() as tg:
        for i, task in enumerate(tasks):
            tg.create_task(one(i, task))
    return [t for t in out if t is not None]
