"""Plain data <-> the typed tree: every value checked against its field's type (ConfigError naming
the dotted key), unknown keys refused, removed keys dropped with a warning.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Sequence

from megatron_sao.config.errors import ConfigError


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for t in args:
            if t is type(None):
                continue
            try:
                return _coerce(value, t, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: cannot be None")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
        return _from_dict(tp, value, key)
    if origin in (list, Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `2e-4` (no dot) as a string; accept what float() reads
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {tp}")


class RemovedConfigKey(UserWarning):
    """A key the schema no longer has was given; it is ignored (the message names it)."""


# Keys that were validated but never read; old configs and run snapshots still carry them.
REMOVED_KEYS: dict[str, str] = {
    "run.log_every": "metrics are logged every step",
    "buffer.max_pending": "admission control (buffer.max_staleness) bounds the finished trajectories held",
    "trainer.global_batch_tokens": "the token budget of a micro-batch is parallel.max_tokens_per_micro_batch",
}


def _drop_removed_keys(data: dict, prefix: str) -> dict:
    import warnings

    out = dict(data)
    for k in list(out):
        key = f"{prefix}.{k}" if prefix else k
        if key in REMOVED_KEYS:
            del out[k]
            warnings.warn(f"{key}: removed from the config schema and ignored ({REMOVED_KEYS[key]})",
                          RemovedConfigKey, stacklevel=2)
    return out


# Keys users of other trainers expect that this one does not support: refused with the reason.
UNSUPPORTED_KEYS: dict[str, str] = {
    "parallel.cp": "context parallelism is not supported: it needs TransformerEngine's attention, which the "
                   "CPU build cannot run or test; long rows train with full recompute and "
                   "parallel.max_tokens_per_micro_batch",
}


def _from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    data = _drop_removed_keys(data, prefix)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    for k in unknown:
        key = f"{prefix}.{k}" if prefix else k
        if key in UNSUPPORTED_KEYS:
            raise ConfigError(f"{key}: {UNSUPPORTED_KEYS[key]}")
    if unknown:
        where = prefix or "top level"
        raise ConfigError(f"{prefix + '.' if prefix else ''}{unknown[0]}: unknown key at {where} "
                          f"(known: {sorted(names)})")
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else k
        kwargs[k] = _coerce(v, hints[k], key)
    # Nested sections not given keep their defaults but must still be dataclass instances.
    obj = cls(**kwargs)
    return obj


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)
