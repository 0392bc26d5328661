"""Typed configuration: one dataclass per concern, loaded from YAML with dotted overrides.

    cfg = load_config("examples/tiny_cpu.yaml", overrides=["algorithm.critic_steps=1", "run.dir=/tmp/x"])

Every key is checked: an unknown key, a value of the wrong type or an impossible value raises
ConfigError naming the dotted key. Paper defaults (SAO, arXiv:2607.07508) are the dataclass
defaults; `PRESETS` holds the per-domain settings (math, coding) that a YAML selects with
`preset: math`.

The modules: `schema` (the dataclasses), `presets`, `coercion` (plain data <-> the typed tree),
`validation`, `loading` (YAML, overrides, the run's snapshot), `errors`. Import from the package.
"""

from megatron_sao.config.coercion import REMOVED_KEYS, RemovedConfigKey, to_dict
from megatron_sao.config.errors import ConfigError
from megatron_sao.config.loading import (
    apply_overrides,
    config_from_dict,
    config_text,
    dump_config,
    load_config,
    parse_override,
)
from megatron_sao.config.presets import PRESETS
from megatron_sao.config.schema import (
    GROUPED_ALGORITHMS,
    PAPER_CRITIC_FREEZE,
    ActorConfig,
    AlgorithmConfig,
    BufferConfig,
    ClusterConfig,
    CriticConfig,
    EnvConfig,
    ModelConfig,
    OptimSection,
    ParallelConfig,
    RolloutConfig,
    RunConfig,
    SAOConfig,
    SFTConfig,
    TrainerConfig,
    ValuePretrainConfig,
    WandbConfig,
)
from megatron_sao.config.validation import validate

__all__ = [
    "ActorConfig", "AlgorithmConfig", "BufferConfig", "ClusterConfig", "ConfigError", "CriticConfig", "EnvConfig",
    "GROUPED_ALGORITHMS", "ModelConfig", "OptimSection", "PAPER_CRITIC_FREEZE", "PRESETS", "ParallelConfig",
    "REMOVED_KEYS", "RemovedConfigKey", "RolloutConfig", "RunConfig", "SAOConfig", "SFTConfig", "TrainerConfig",
    "ValuePretrainConfig", "apply_overrides", "config_from_dict", "config_text", "dump_config", "load_config",
    "parse_override",
    "to_dict", "validate", "WandbConfig",
]
