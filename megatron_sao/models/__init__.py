"""Megatron-Core model providers built from HF configs: actor/critic GPT models, freezing, presets.

Import `megatron_sao.models.gpt` (which imports megatron.core) only where a model is built;
`hf_config`, `parallel_sizes` and `presets` are light.
"""

from megatron_sao.models.hf_config import ModelSpec, load_hf_config, model_spec_from_hf
from megatron_sao.models.parallel_sizes import ParallelSizes

__all__ = ["ModelSpec", "ParallelSizes", "load_hf_config", "model_spec_from_hf"]
