"""The full (unsharded) Megatron parameter set of a model: names and shapes, from a `ModelSpec`.

Used to validate converted state dicts before anything is written (a missing tensor or a shape
that does not fit the config fails with the tensor's name) and to enumerate what each rank owns.
"""

from __future__ import annotations

from functools import lru_cache

from megatron_sao.models.hf_config import ModelSpec

ROLES = ("actor", "critic")


def layer_param_shapes(spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """Canonical full names and shapes of one decoder layer (global layer index)."""
    h, d = spec.hidden_size, spec.head_dim
    qkv_rows = (spec.num_attention_heads + 2 * spec.num_kv_heads) * d
    p = f"decoder.layers.{layer}."
    out = {
        p + "input_layernorm.weight": (h,),
        p + "self_attention.linear_qkv.weight": (qkv_rows, h),
        p + "self_attention.linear_proj.weight": (h, spec.num_attention_heads * d),
        p + "pre_mlp_layernorm.weight": (h,),
    }
    if spec.qk_layernorm:
        out[p + "self_attention.q_layernorm.weight"] = (d,)
        out[p + "self_attention.k_layernorm.weight"] = (d,)
    if spec.is_moe:
        out[p + "mlp.router.weight"] = (spec.num_experts, h)
        for e in range(spec.num_experts):
            q = f"{p}mlp.experts.local_experts.{e}."
            out[q + "linear_fc1.weight"] = (2 * spec.moe_ffn_hidden_size, h)
            out[q + "linear_fc2.weight"] = (h, spec.moe_ffn_hidden_size)
    else:
        out[p + "mlp.linear_fc1.weight"] = (2 * spec.ffn_hidden_size, h)
        out[p + "mlp.linear_fc2.weight"] = (h, spec.ffn_hidden_size)
    return out


def full_param_shapes(spec: ModelSpec, role: str = "actor") -> dict[str, tuple[int, ...]]:
    """Every canonical full parameter of the model (the conversion's contract).

    Tied actors have no `output_layer.weight` entry: the head *is* the embedding (Megatron's
    last PP stage holds a copy, filled from the embedding by the loader).
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    out: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (spec.vocab_size, spec.hidden_size)}
    for layer in range(spec.num_layers):
        out.update(layer_param_shapes(spec, layer))
    out["decoder.final_layernorm.weight"] = (spec.hidden_size,)
    if role == "critic":
        out["value_head.weight"] = (1, spec.hidden_size)
        out["value_head.bias"] = (1,)
    elif not spec.tie_word_embeddings:
        out["output_layer.weight"] = (spec.vocab_size, spec.hidden_size)
    return out


@lru_cache(maxsize=8)
def _all_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    shapes = full_param_shapes(spec, "critic")
    shapes["output_layer.weight"] = (spec.vocab_size, spec.hidden_size)
    return shapes


def expected_shape(global_name: str, spec: ModelSpec) -> tuple[int, ...]:
    """Full shape of one canonical global parameter; ValueError if the model has no such name."""
    try:
        return _all_shapes(spec)[global_name]
    except KeyError:
        raise ValueError(f"{spec.arch} model has no Megatron parameter {global_name!r}") from None
