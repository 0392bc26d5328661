"""Name -> environment factory and name -> task loader, so configs can refer to envs by string.

Modules are imported lazily: importing the registry must not pull in math-verify/sympy (slow)
when a run only uses the toy task.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from megatron_sao.envs.base import Environment, TaskSource

# env name -> (module, environment class, task loader function)
_BUILTIN: dict[str, tuple[str, str, str]] = {
    "math_python": ("megatron_sao.envs.math_python", "MathPythonEnv", "load_math_tasks"),
    "coding": ("megatron_sao.envs.coding", "CodingEnv", "load_coding_tasks"),
    "style_shift": ("megatron_sao.envs.style_shift", "StyleShiftEnv", "load_style_tasks"),
    "toy_tool": ("megatron_sao.envs.toy_tool", "ToyToolEnv", "load_toy_tasks"),
    "arith_python": ("megatron_sao.envs.arith_python", "ArithPythonEnv", "load_arith_tasks"),
    "toy_chain": ("megatron_sao.envs.toy_chain", "ToyChainEnv", "load_toy_chain_tasks"),
    "chain_python": ("megatron_sao.envs.chain_python", "ChainPythonEnv", "load_chain_tasks"),
}
# Environments whose tasks come from a seeded generator configured by keyword arguments alone.
GENERATED = ("style_shift", "toy_tool", "toy_chain")
_CUSTOM_ENVS: dict[str, Callable[..., Environment]] = {}
_CUSTOM_LOADERS: dict[str, Callable[..., TaskSource]] = {}


# env name -> (module, function): the actions of a correct episode of a task (`reference_actions(task)`
# -> list[str]), for the oracle value of trainer/oracle_value.py. Only tasks with one known solution path.
_REFERENCE_ACTIONS: dict[str, tuple[str, str]] = {
    "toy_tool": ("megatron_sao.envs.toy_tool", "reference_actions"),
    "arith_python": ("megatron_sao.envs.arith_python", "reference_actions"),
    "toy_chain": ("megatron_sao.envs.toy_chain", "reference_actions"),
    "chain_python": ("megatron_sao.envs.chain_python", "reference_actions"),
}


def reference_actions_of(name: str) -> Callable[[Any], list[str]] | None:
    """The environment's reference solution function, or None when it has none (open-ended tasks)."""
    if name not in _REFERENCE_ACTIONS:
        return None
    module, attr = _REFERENCE_ACTIONS[name]
    return getattr(importlib.import_module(module), attr)


def available_envs() -> list[str]:
    return sorted(set(_BUILTIN) | set(_CUSTOM_ENVS))


def register_env(name: str, factory: Callable[..., Environment],
                 loader: Callable[..., TaskSource] | None = None) -> None:
    """Add a user environment (and optionally its task loader) under ``name``."""
    if name in _BUILTIN or name in _CUSTOM_ENVS:
        raise ValueError(f"environment {name!r} is already registered")
    _CUSTOM_ENVS[name] = factory
    if loader is not None:
        _CUSTOM_LOADERS[name] = loader


def _builtin_attr(name: str, which: int) -> Any:
    module, *attrs = _BUILTIN[name]
    return getattr(importlib.import_module(module), attrs[which])


def _unknown(name: str) -> ValueError:
    return ValueError(f"unknown environment {name!r}; available: {available_envs()}")


def make_env(name: str, **kwargs: Any) -> Environment:
    """A fresh environment instance (one per trajectory); ``kwargs`` go to its constructor."""
    if name in _CUSTOM_ENVS:
        return _CUSTOM_ENVS[name](**kwargs)
    if name not in _BUILTIN:
        raise _unknown(name)
    cls = _builtin_attr(name, 0)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise TypeError(f"make_env({name!r}): bad arguments {sorted(kwargs)}: {e}") from None


def load_tasks(name: str, path_or_spec: str | None = None, **kwargs: Any) -> TaskSource:
    """Tasks for environment ``name``.

    ``path_or_spec`` is a dataset path or short name for ``math_python`` (``"aime25"`` with
    ``data_dir=`` or $SAO_DATA_DIR), a jsonl path or ``"builtin"`` for ``coding``, the split
    (``"train"`` / ``"eval"``, disjoint by content) for ``arith_python`` and ``chain_python``; the
    generated tasks (``style_shift``, ``toy_tool``, ``toy_chain``) take no path and are configured by ``kwargs``
    (``n``, ``seed``, ``max_ops``...).
    """
    if name in _CUSTOM_LOADERS:
        return _CUSTOM_LOADERS[name](path_or_spec, **kwargs)
    if name not in _BUILTIN:
        raise _unknown(name)
    loader = _builtin_attr(name, 1)
    if name in GENERATED:
        if path_or_spec not in (None, "", "builtin", "generated"):
            raise ValueError(f"load_tasks({name!r}) generates its tasks; pass n=/seed= instead of "
                             f"{path_or_spec!r}")
        return loader(**kwargs)
    if name == "math_python" and not path_or_spec:
        raise ValueError("load_tasks('math_python') needs a dataset path or name, e.g. 'aime25'")
    return loader(path_or_spec, **kwargs)
