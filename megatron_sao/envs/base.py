"""The environment protocol: the only thing the agent loop knows about a task.

One ``Task`` is one prompt and yields one trajectory (SAO is single-rollout). The agent loop
creates one ``Environment`` per trajectory, calls ``reset(task)``, then alternates model turns
and ``step(action_text)`` until ``StepResult.done``. Environments are stateful across turns and
never see tokens: they take decoded text and return text, so they stay independent of the
tokenizer, the chat template and the rollout engine.

Conventions shared by every environment in this package:

* ``StepResult.reward`` is only meaningful when ``done`` is True; the agent loop places it on
  the last action token (never on an observation token).
* An action that contains neither a tool call nor a final answer ends the episode with reward 0
  and ``info["reason"] == "no_tool_call_or_answer"``: the policy gave up the turn, and treating
  it as "keep talking" would let a broken policy loop until the turn limit.
* A turn limit reached by an environment ends the episode with ``info["truncated"] = True``. The
  environment accepts no further action, so the agent loop keeps its reward and treats the end as
  terminal for the return (bootstrap 0; rollout/agent_loop.py).
* ``info["tool_calls"]`` counts the tool calls executed so far (environments with tools).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable


@dataclass
class Task:
    """One prompt, i.e. one trajectory.

    ``answer`` is the gold answer / hidden tests / judge spec and is never shown to the policy.
    ``meta`` carries optional extras (dataset source, difficulty, ``policy_step`` for
    non-stationary tasks, ...).
    """

    prompt_id: str
    messages: list[dict]
    answer: Any
    env: str
    meta: dict = field(default_factory=dict)


@dataclass
class StepResult:
    """What an environment returns for one model turn.

    ``observation`` is the text to append as a tool/user message (None once the episode is over).
    """

    observation: str | None
    done: bool
    reward: float = 0.0
    info: dict = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One instance per trajectory, created by a factory (see ``registry.make_env``)."""

    name: str

    async def reset(self, task: Task) -> None: ...

    async def step(self, action_text: str) -> StepResult: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class ModelEndpoint:
    """Where a harness environment's agent reaches the policy: an OpenAI-compatible base URL (ending
    in ``/v1``) of this episode alone, its API key, and the model name to ask for. ``stop()`` ends the
    episode's model access at once (the environment's own wall limit); later requests are refused."""

    base_url: str
    api_key: str
    model: str
    stop: Callable[[], None] | None = None


@dataclass
class HarnessOutcome:
    """What a harness environment says when its agent stopped and the grader ran: the episode's reward
    (from the environment's own grader, never from the harness) and what happened."""

    reward: float
    info: dict = field(default_factory=dict)


@runtime_checkable
class HarnessEnvironment(Protocol):
    """An environment that runs an agent harness of its own (mini-swe-agent, ...): the harness talks to
    the policy through an OpenAI-compatible endpoint (``rollout/agent_endpoint/``) instead of the agent
    loop stepping the environment turn by turn. One instance per episode, like ``Environment``."""

    name: str

    async def run_harness(self, task: Task, endpoint: ModelEndpoint) -> HarnessOutcome: ...

    async def close(self) -> None: ...


def is_harness(env: Any) -> bool:
    return callable(getattr(env, "run_harness", None))


@runtime_checkable
class TaskSource(Protocol):
    """A dataset of tasks, indexable like a list."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> Task: ...


class ListTaskSource:
    """A ``TaskSource`` over an in-memory list of tasks (what every loader here returns)."""

    def __init__(self, tasks: Sequence[Task]) -> None:
        ids = [t.prompt_id for t in tasks]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"duplicate prompt_id {dup!r} in task list")
        self._tasks = list(tasks)

    def __len__(self) -> int:
        return len(self._tasks)

    def __getitem__(self, i: int) -> Task:
        if not isinstance(i, int):
            raise TypeError(f"task index must be an int, got {type(i).__name__}")
        return self._tasks[i]

    def __iter__(self):
        return iter(self._tasks)


def require_task(env_name: str, task: Task | None) -> Task:
    """Return ``task`` or raise a clear error when ``step`` is called before ``reset``."""
    if task is None:
        raise RuntimeError(f"{env_name}: step() called before reset(task)")
    return task


def check_task_env(env_name: str, task: Task) -> None:
    """Reject a task that belongs to another environment (a wiring bug, not a policy error)."""
    if not isinstance(task, Task):
        raise TypeError(f"{env_name}: reset() expects a Task, got {type(task).__name__}")
    if task.env != env_name:
        raise ValueError(f"{env_name}: task {task.prompt_id!r} is for env {task.env!r}")
