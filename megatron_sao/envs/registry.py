"""Name -> environment, its tasks and (where it has them) its generated demonstrations, so configs can
refer to environments by string and the trainer never names one.

What the trainer asks of an environment by name: ``make_env`` (one instance per trajectory),
``load_tasks`` (the training or held-out tasks), ``generates_tasks`` (tasks from a seeded generator,
sized by ``n=`` and seeded by ``seed=``, instead of a file) and ``make_demonstrations`` (SFT
conversations drawn from the same task settings as the RL prompts, for environments that can
write them).

Modules are imported lazily: importing the registry must not pull in math-verify/sympy (slow)
when a run only uses the toy task.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from megatron_sao.envs.base import Environment, TaskSource, is_harness


@dataclass(frozen=True)
class EnvEntry:
    """One registered environment. Built-ins name their module and attributes (imported on first use);
    user environments give the callables."""

    factory: Callable[..., Environment] | str
    loader: Callable[..., TaskSource] | str | None = None
    generated_tasks: bool = False  # tasks from a seeded generator (n=, seed=), not from a file
    # (n, seed=, error_rate=, **settings) -> conversations; takes the task and env settings it knows
    demonstrations: Callable[..., list] | str | None = None
    # task -> the actions of a correct episode, for the oracle value (trainer/oracle_value.py); only
    # tasks with one known solution path have it
    reference_actions: Callable[[Any], list[str]] | str | None = None
    module: str | None = None  # where the string attributes above live


_BUILTIN: dict[str, EnvEntry] = {
    "math_python": EnvEntry("MathPythonEnv", "load_math_tasks", module="megatron_sao.envs.math_python"),
    "coding": EnvEntry("CodingEnv", "load_coding_tasks", module="megatron_sao.envs.coding"),
    "style_shift": EnvEntry("StyleShiftEnv", "load_style_tasks", generated_tasks=True,
                            demonstrations="make_demonstrations", module="megatron_sao.envs.style_shift"),
    "toy_tool": EnvEntry("ToyToolEnv", "load_toy_tasks", generated_tasks=True, demonstrations="make_demonstrations",
                         reference_actions="reference_actions", module="megatron_sao.envs.toy_tool"),
    "arith_python": EnvEntry("ArithPythonEnv", "load_arith_tasks", demonstrations="make_demonstrations",
                             reference_actions="reference_actions", module="megatron_sao.envs.arith_python"),
    "toy_chain": EnvEntry("ToyChainEnv", "load_toy_chain_tasks", generated_tasks=True,
                          demonstrations="make_demonstrations", reference_actions="reference_actions",
                          module="megatron_sao.envs.toy_chain"),
    "chain_python": EnvEntry("ChainPythonEnv", "load_chain_tasks", demonstrations="make_demonstrations",
                             reference_actions="reference_actions", module="megatron_sao.envs.chain_python"),
    "swe": EnvEntry("SWEEnv", "load_swe_tasks", module="megatron_sao.envs.swe.env"),  # a harness: mini-swe-agent
}
_CUSTOM: dict[str, EnvEntry] = {}


def reference_actions_of(name: str) -> Callable[[Any], list[str]] | None:
    """The environment's reference solution function, or None when it has none (open-ended tasks)."""
    entry = _entry(name)
    return _resolve(entry, entry.reference_actions)


def available_envs() -> list[str]:
    return sorted(set(_BUILTIN) | set(_CUSTOM))


def register_env(name: str, factory: Callable[..., Environment], loader: Callable[..., TaskSource] | None = None,
                 *, generated_tasks: bool = False, demonstrations: Callable[..., list] | None = None) -> None:
    """Add a user environment under ``name``: its factory, optionally its task loader (``generated_tasks``:
    the loader takes ``n=`` and ``seed=`` instead of a path) and a demonstration generator for ``sao sft``."""
    if name in _BUILTIN or name in _CUSTOM:
        raise ValueError(f"environment {name!r} is already registered")
    _CUSTOM[name] = EnvEntry(factory, loader, generated_tasks, demonstrations)


def _entry(name: str) -> EnvEntry:
    entry = _CUSTOM.get(name) or _BUILTIN.get(name)
    if entry is None:
        raise ValueError(f"unknown environment {name!r}; available: {available_envs()}")
    return entry


def _resolve(entry: EnvEntry, attr: Callable | str | None) -> Callable | None:
    if isinstance(attr, str):
        return getattr(importlib.import_module(entry.module), attr)
    return attr


def generates_tasks(name: str) -> bool:
    """Whether ``name``'s tasks come from a seeded generator (``n=``, ``seed=``) rather than a file."""
    return _entry(name).generated_tasks


def runs_harness(name: str) -> bool:
    """Whether environment ``name`` runs an agent harness of its own (``base.HarnessEnvironment``): its
    episodes then need the agent endpoint. Unknown names are False (``make_env`` names them)."""
    entry = _CUSTOM.get(name) or _BUILTIN.get(name)
    return entry is not None and is_harness(_resolve(entry, entry.factory))


def make_env(name: str, **kwargs: Any) -> Environment:
    """A fresh environment instance (one per trajectory); ``kwargs`` go to its constructor."""
    entry = _entry(name)
    cls = _resolve(entry, entry.factory)
    if entry.module is None:  # a user factory: its own errors are its own
        return cls(**kwargs)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise TypeError(f"make_env({name!r}): bad arguments {sorted(kwargs)}: {e}") from None


def load_tasks(name: str, path_or_spec: str | None = None, **kwargs: Any) -> TaskSource:
    """Tasks for environment ``name``.

    ``path_or_spec`` is a dataset path or short name for ``math_python`` (``"aime25"`` with
    ``data_dir=`` or $SAO_DATA_DIR), a jsonl path or ``"builtin"`` for ``coding``, the split
    (``"train"`` / ``"eval"``, disjoint by content) for ``arith_python``, ``chain_python`` and for ``swe``'s
    generated tasks (or a SWE-bench jsonl, with ``repos_dir=``); environments whose tasks are generated
    (``generates_tasks``) take no path and are configured by ``kwargs`` (``n``, ``seed``, ``max_ops``...).
    """
    entry = _entry(name)
    loader = _resolve(entry, entry.loader)
    if loader is None:
        raise ValueError(f"environment {name!r} was registered without a task loader")
    if entry.generated_tasks:
        if path_or_spec not in (None, "", "builtin", "generated"):
            raise ValueError(f"load_tasks({name!r}) generates its tasks; pass n=/seed= instead of "
                             f"{path_or_spec!r}")
        return loader(**kwargs)
    return loader(path_or_spec, **kwargs)


def has_demonstrations(name: str) -> bool:
    return _entry(name).demonstrations is not None


def make_demonstrations(name: str, n: int, *, seed: int, error_rate: float,
                        settings: dict[str, Any]) -> list[list[dict]]:
    """``n`` SFT conversations (lists of chat messages) for ``name``'s tasks. ``settings`` are the run's
    task and environment settings (``env.task_kwargs`` and ``env.kwargs``); the generator takes those it
    knows (its keyword parameters), so the demonstrations start exactly like the RL prompts."""
    entry = _entry(name)
    make = _resolve(entry, entry.demonstrations)
    if make is None:
        raise ValueError(f"sft.data: env {name!r} has no demonstration generator; give a jsonl file")
    params = inspect.signature(make).parameters
    offered = {**{k: v for k, v in settings.items() if k != "n"}, "seed": seed, "error_rate": error_rate}
    demos = make(n, **{k: v for k, v in offered.items() if k in params})
    return [d if isinstance(d, list) else d["messages"] for d in demos]
