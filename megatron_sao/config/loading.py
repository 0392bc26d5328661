"""Where a config comes from and goes to: a YAML file, dotted overrides, the preset, the defaults,
then types and validation; and the run's snapshot written back as YAML.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import yaml

from megatron_sao.config.coercion import _from_dict, to_dict
from megatron_sao.config.errors import ConfigError
from megatron_sao.config.presets import PRESETS
from megatron_sao.config.schema import SAOConfig
from megatron_sao.config.strict_yaml import StrictYAMLError, load_strict
from megatron_sao.config.validation import validate


def _deep_merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _merge_into_defaults(cls: type, data: dict) -> dict:
    """Fill nested sections so that a partial section keeps the other defaults of that section."""
    defaults = to_dict(cls())
    return _deep_merge(defaults, data)


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key.path=value")
    key, raw = item.split("=", 1)
    key = key.strip().lstrip("-")
    if not key:
        raise ConfigError(f"override {item!r}: empty key")
    try:
        value = load_strict(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {key}: cannot parse value {raw!r}: {e}") from e
    return key.split("."), value


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    data = _deep_merge({}, data)
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for i, part in enumerate(path[:-1]):
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"{'.'.join(path[:i + 1])}: is a value, cannot set {'.'.join(path)}")
            node = nxt
        node[path[-1]] = value
    return data


def config_from_dict(data: dict, overrides: Sequence[str] = ()) -> SAOConfig:
    data = apply_overrides(data or {}, overrides)
    preset = data.get("preset")
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"preset: unknown preset {preset!r}; known: {sorted(PRESETS)}")
        # The preset sits between the defaults and the file: the file (and overrides) win.
        data = _deep_merge(PRESETS[preset], data)
    data = _merge_into_defaults(SAOConfig, data)
    return validate(_from_dict(SAOConfig, data))


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> SAOConfig:
    data: dict = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config file {p} is a directory, not a YAML file")
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: not a YAML text file (byte {e.start} is not UTF-8)") from None
        except OSError as e:
            raise ConfigError(f"config file {p}: cannot be read: {e.strerror}") from None
        try:
            data = load_strict(text)
        except StrictYAMLError as e:
            raise ConfigError(f"{p}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: invalid YAML: {e}") from e
        if data is None or data == {}:
            # Every default is a 100-step run of the demo model: an empty file is a mistake, not a choice.
            raise ConfigError(f"{p}: the config is empty (no settings); write at least the keys that differ "
                              "from the defaults, e.g. a preset, model.path and env.name")
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: top level must be a mapping")
    cfg = config_from_dict(data, overrides)
    _check_env_name(cfg.env.name)
    return cfg


def _check_env_name(name: str) -> None:
    """Every command loads its config first: an unknown environment is reported before anything is
    written (the Python API, config_from_dict, may register its own environments later)."""
    from megatron_sao.envs.registry import available_envs

    if name not in available_envs():
        raise ConfigError(f"env.name: unknown environment {name!r}; available: {', '.join(available_envs())}")


def config_text(cfg: SAOConfig) -> str:
    """The resolved config as the run's snapshot holds it (YAML, sections in schema order)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def dump_config(cfg: SAOConfig, path: str | Path) -> None:
    """Write the resolved config (the run's snapshot) atomically."""
    p = Path(path)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(config_text(cfg))
    tmp.replace(p)
