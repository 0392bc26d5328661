"""Architecture facts of an HF checkpoint, reduced to what the Megatron side needs (`ModelSpec`).

Every consumer (model builder, HF <-> Megatron mapping, sharding, parallel planner) reads the
`ModelSpec`, never the raw HF config, so HF-version quirks (transformers 5.x moved `rope_theta`
into `rope_parameters`; MoE configs spell the expert count `num_experts` or `num_local_experts`)
are handled once, here. Anything the Megatron model cannot reproduce exactly (attention bias,
sliding windows, scaled RoPE, dense layers inside an MoE stack) is refused with an error that
names the field, instead of producing a model whose logits silently differ from the HF one.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from transformers import AutoConfig, PretrainedConfig

SUPPORTED_ARCHS = ("qwen3_moe", "qwen3", "llama")


@dataclass(frozen=True)
class ModelSpec:
    """Everything the mapping, the model builder and the planner need from an HF config."""

    arch: str  # "qwen3_moe" | "qwen3" | "llama"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int  # dense MLP width (HF intermediate_size); unused by MoE layers
    num_experts: int  # 0 = dense model
    moe_topk: int
    moe_ffn_hidden_size: int  # per-expert width (HF moe_intermediate_size); 0 for dense
    norm_topk_prob: bool  # renormalise the top-k router probabilities (Qwen3-30B-A3B: True)
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qk_layernorm: bool
    max_position_embeddings: int

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def heads_per_group(self) -> int:
        """Query heads per KV (query) group."""
        return self.num_attention_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelSpec":
        fields = set(cls.__dataclass_fields__)
        missing = fields - set(data)
        if missing:
            raise ValueError(f"ModelSpec dict is missing field(s) {sorted(missing)}")
        return cls(**{k: data[k] for k in fields})


def load_hf_config(path_or_dict: str | os.PathLike | Mapping[str, Any] | PretrainedConfig) -> PretrainedConfig:
    """An HF config from a checkpoint directory, a config.json path, a dict or a config object.

    Loading goes through `AutoConfig` with `model_type` so that no remote code is executed and the
    config class applies its own defaults (e.g. transformers 5.x builds `rope_parameters` from a
    legacy top-level `rope_theta`).
    """
    if isinstance(path_or_dict, PretrainedConfig):
        return path_or_dict
    if isinstance(path_or_dict, Mapping):
        data = dict(path_or_dict)
    else:
        path = os.fspath(path_or_dict)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no HF config at {path}")
        with open(path) as f:
            data = json.load(f)
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise ValueError("HF config has no 'model_type' field; cannot tell the architecture")
    data = {k: v for k, v in data.items() if not k.startswith("_")}
    return AutoConfig.for_model(model_type, **data)


def _get(cfg: PretrainedConfig, *names: str, default: Any = None, required: bool = True) -> Any:
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    if required and default is None:
        raise ValueError(f"HF config ({cfg.model_type}) has no field {' / '.join(names)}")
    return default


def _rope_theta(cfg: PretrainedConfig) -> float:
    """RoPE base from transformers 5.x `rope_parameters` or the legacy top-level `rope_theta`.

    Only plain RoPE is supported: scaled variants (llama3, yarn, ...) change the frequencies and
    the Megatron RotaryEmbedding built here would not match them.
    """
    params = getattr(cfg, "rope_parameters", None) or {}
    scaling = getattr(cfg, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in ("default", None):
        raise ValueError(f"HF config field rope_parameters.rope_type={rope_type!r} is not supported "
                         "(only plain RoPE, rope_type 'default')")
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None:
        raise ValueError("HF config has neither rope_parameters.rope_theta nor rope_theta")
    return float(theta)


def _check_unsupported(cfg: PretrainedConfig) -> None:
    if getattr(cfg, "attention_bias", False):
        raise ValueError("HF config field attention_bias=True is not supported (no qkv bias in this mapping)")
    if getattr(cfg, "mlp_bias", False):
        raise ValueError("HF config field mlp_bias=True is not supported")
    if getattr(cfg, "use_sliding_window", False):
        raise ValueError("HF config field use_sliding_window=True is not supported")
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"HF config field hidden_act={act!r} is not supported (SwiGLU/silu only)")
    if cfg.model_type == "qwen3_moe":
        if getattr(cfg, "mlp_only_layers", None):
            raise ValueError(f"HF config field mlp_only_layers={cfg.mlp_only_layers} is not supported "
                             "(every layer must be an MoE layer)")
        if getattr(cfg, "decoder_sparse_step", 1) != 1:
            raise ValueError(f"HF config field decoder_sparse_step={cfg.decoder_sparse_step} is not "
                             "supported (must be 1: every layer an MoE layer)")


def model_spec_from_hf(hf_config: PretrainedConfig | Mapping[str, Any] | str | os.PathLike) -> ModelSpec:
    """Build the `ModelSpec` of an HF config; raises ValueError naming the offending field."""
    cfg = load_hf_config(hf_config)
    arch = cfg.model_type
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported architecture model_type={arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    _check_unsupported(cfg)
    hidden = int(_get(cfg, "hidden_size"))
    heads = int(_get(cfg, "num_attention_heads"))
    kv_heads = int(_get(cfg, "num_key_value_heads", default=heads, required=False))
    head_dim = int(_get(cfg, "head_dim", default=hidden // heads, required=False))
    if heads % kv_heads:
        raise ValueError(f"HF config: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    moe = arch == "qwen3_moe"
    spec = ModelSpec(
        arch=arch,
        vocab_size=int(_get(cfg, "vocab_size")),
        hidden_size=hidden,
        num_layers=int(_get(cfg, "num_hidden_layers")),
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_hidden_size=int(_get(cfg, "intermediate_size")),
        num_experts=int(_get(cfg, "num_experts", "num_local_experts")) if moe else 0,
        moe_topk=int(_get(cfg, "num_experts_per_tok")) if moe else 0,
        moe_ffn_hidden_size=int(_get(cfg, "moe_intermediate_size")) if moe else 0,
        norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", False)) if moe else False,
        rope_theta=_rope_theta(cfg),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps")),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qk_layernorm=arch in ("qwen3_moe", "qwen3"),
        max_position_embeddings=int(_get(cfg, "max_position_embeddings")),
    )
    if spec.is_moe and not 0 < spec.moe_topk <= spec.num_experts:
        raise ValueError(f"HF config: num_experts_per_tok={spec.moe_topk} must be in 1..num_experts={spec.num_experts}")
    return spec
