"""Megatron-Core GPT models (actor and critic) built from a `ModelSpec`.

`transformer_config_from_spec` turns the HF architecture facts into a TransformerConfig whose
forward pass reproduces the HF model exactly (checked to <= 1e-5 in float32 by the tests);
`build_gpt_model` builds the actor (vocab-parallel logits over the padded vocabulary, see
models/vocab.py) or the critic (scalar values). Attention is causal by mask type
(AttnMaskType.causal in every layer spec): callers pass attention_mask=None.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_sao.models.hf_config import ModelSpec
from megatron_sao.models.layer_specs import decoder_block_spec, transformer_engine_usable
from megatron_sao.models.parallel_sizes import ParallelSizes
from megatron_sao.models.precision import FUSED, UNFUSED, attention_kernel
from megatron_sao.models.value_head import ValueHead
from megatron_sao.models.vocab import padded_vocab_size

logger = logging.getLogger(__name__)

ROLES = ("actor", "critic")


def _backend_settings(use_te: bool, params_dtype: torch.dtype) -> dict[str, Any]:
    """Kernel/fusion switches. The CPU set is the one verified on gloo (tests/integration/megatron); the TE set
    is the usual GPU choice (grouped GEMM, all-to-all dispatch, fused kernels) and has NOT been run
    by this project's tests (no GPU here).

    Attention on TE is pinned to the kernel `precision.attention_kernel` names (what `sao plan`
    counts): cuDNN fused attention for bf16 (TE raises if it cannot run it, instead of silently
    falling back to the s x s unfused kernel, as AttnBackend.auto would), unfused for fp32.
    """
    if use_te:
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[params_dtype]
        backend = AttnBackend.fused if attention_kernel(dtype, use_te=True) == FUSED else AttnBackend.unfused
        return dict(attention_backend=backend, moe_token_dispatcher_type="alltoall",
                    moe_grouped_gemm=True, bias_activation_fusion=True, masked_softmax_fusion=True,
                    apply_rope_fusion=True, moe_permute_fusion=False, moe_router_fusion=False,
                    gradient_accumulation_fusion=False, persist_layer_norm=False,
                    bias_dropout_fusion=True)
    return dict(
        attention_backend=AttnBackend.local,
        # "alltoall" builds torch.cuda streams; "allgather" is the dispatcher verified on CPU.
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, moe_permute_fusion=False, moe_router_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        use_cpu_initialization=True,
        batch_p2p_sync=False,  # the p2p sync path calls torch.cuda.synchronize
    )


def config_attention_kernel(config: TransformerConfig | dict) -> str:
    """"fused" or "unfused": the attention kernel a config (or its kwargs) runs (precision.attention_kernel)."""
    backend = config["attention_backend"] if isinstance(config, dict) else config.attention_backend
    return FUSED if backend in (AttnBackend.fused, AttnBackend.flash) else UNFUSED


def transformer_config_from_spec(spec: ModelSpec, par: ParallelSizes, *, params_dtype: torch.dtype = torch.float32,
                                 use_te: bool | None = None, **overrides: Any) -> TransformerConfig:
    """TransformerConfig equivalent to the HF model `spec`, sharded as `par` (see `transformer_config_kwargs`)."""
    return TransformerConfig(**transformer_config_kwargs(spec, par, params_dtype=params_dtype, use_te=use_te,
                                                         **overrides))


def transformer_config_kwargs(spec: ModelSpec, par: ParallelSizes, *, params_dtype: torch.dtype = torch.float32,
                              use_te: bool | None = None, **overrides: Any) -> dict[str, Any]:
    """The TransformerConfig fields for the HF model `spec`, sharded as `par`.

    Kept apart from the TransformerConfig itself because a TE config cannot be constructed where
    TransformerEngine is absent (TransformerConfig checks for the fused kernels): tests read these
    fields to see what a GPU node builds.

    `params_dtype` bfloat16 turns on Megatron's mixed precision (bf16=True: bf16 weights and
    activations; the optimizer keeps fp32 main params, see megatron/optimizer.py). `use_te`
    (default: `transformer_engine_usable()`) picks the kernel set; pass True to see the config a
    GPU node builds.

    `overrides` win over everything (e.g. moe_aux_loss_coeff, recompute settings). MoE routing:
    Qwen3 takes softmax over all experts then top-k; norm_topk_prob=True renormalises the k
    probabilities, which equals Megatron's top-k-then-softmax (moe_router_pre_softmax=False);
    norm_topk_prob=False equals softmax-then-top-k (pre_softmax=True). The auxiliary
    load-balancing loss is off by default (it changes gradients, not logits); turn it on with
    `moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=...`.
    """
    if params_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"params_dtype must be float32, bfloat16 or float16, got {params_dtype}")
    par.validate_for(spec)
    kw: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        qk_layernorm=spec.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.expert_tp,
        sequence_parallel=par.sequence_parallel,
        **_backend_settings(transformer_engine_usable() if use_te is None else use_te, params_dtype),
    )
    if spec.is_moe:
        kw.update(
            num_moe_experts=spec.num_experts,
            moe_router_topk=spec.moe_topk,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not spec.norm_topk_prob,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
        )
    else:
        kw["moe_token_dispatcher_type"] = "allgather"  # unused for dense; keeps the check quiet
    kw.update(overrides)
    return kw


class ActorGPTModel(GPTModel):
    """GPTModel that can hand back its logits in the output layer's own layout.

    Called without labels it is GPTModel: logits [B, S, V/TP], which GPTModel makes by transposing
    the output layer's [S, B, V/TP] and copying it contiguous (and the backward pass copies the
    gradient back). Called with `labels` (any [B, S] tensor; the engine passes the tokens) it returns
    the [S, B, V/TP] logits as the output layer made them, untouched: the engine's chunked log-prob
    pass reads them in that layout (megatron/forward.py::token_logprobs, seq_first), so neither copy
    of the largest activation is made (0.65 s of a 10 s actor step on SmolLM2-135M).
    """

    def compute_language_model_loss(self, labels, logits):
        return logits  # GPTModel's labels path: no cross entropy here, the engine computes the log-probs


class CriticGPTModel(GPTModel):
    """GPTModel whose vocabulary projection is replaced by a scalar `value_head`.

    The head is registered once, as `value_head` (so checkpoints and the HF mapping see
    `value_head.weight`, not a [1, H] `output_layer.weight`), and `output_layer` resolves to it so
    that GPTModel's own post-processing calls it. Call it with labels=None: it returns values
    [B, S, 1]; labels would make GPTModel compute a (meaningless) LM loss on them.
    """

    def __init__(self, *args: Any, value_head_init: str = "zero", **kwargs: Any) -> None:
        if kwargs.get("share_embeddings_and_output_weights"):
            raise ValueError("critic cannot tie its value head to the embedding")
        super().__init__(*args, **kwargs)
        if self.post_process:
            del self.output_layer
            tp_group = getattr(getattr(self, "pg_collection", None), "tp", None)
            self.value_head = ValueHead(self.config, init=value_head_init, tp_group=tp_group)

    def __getattr__(self, name: str):
        if name == "output_layer" and "value_head" in self.__dict__.get("_modules", {}):
            return self._modules["value_head"]
        return super().__getattr__(name)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron's default (every submodule's own sharded state dict, `value_head` replicated over TP).
        LanguageModule's would mark `output_layer.weight` as vocabulary-padded (allow_shape_mismatch) and
        fails with KeyError on the critic, whose last stage has `value_head` instead: one output, nothing
        padded. Nothing else of GPTModel's applies (no tied embedding, no multi-token prediction)."""
        return MegatronModule.sharded_state_dict(self, prefix, sharded_offsets, metadata)


def build_gpt_model(spec: ModelSpec, config: TransformerConfig, *, role: str = "actor", pre_process: bool = True,
                    post_process: bool = True, value_head_init: str = "zero", vp_stage: int | None = None,
                    **gpt_kwargs: Any) -> GPTModel:
    """Actor (logits [B, S, V/TP], parallel_output=True) or critic (values [B, S, 1]) for `spec`.

    Call after `initialize_model_parallel` (and, on CPU, `ensure_cpu_compat()`); `pre_process` /
    `post_process` are this pipeline stage's first/last flags. Forward as
    `model(input_ids, position_ids, None)`: attention is causal by mask type. The actor's logits
    have `padded_vocab_size(V, TP)` columns; mask the padding (megatron.logprobs.vocab_parallel_logprobs)
    before any softmax.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    use_te = config.attention_backend != AttnBackend.local  # the spec the config's kernels were chosen for
    kwargs: dict[str, Any] = dict(
        config=config,
        transformer_layer_spec=decoder_block_spec(config, use_te=use_te, vp_stage=vp_stage),
        vocab_size=padded_vocab_size(spec.vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings and role == "actor",
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=spec.rope_theta,
        vp_stage=vp_stage,
        **gpt_kwargs,
    )
    if role == "critic":
        model: GPTModel = CriticGPTModel(value_head_init=value_head_init, **kwargs)
    else:
        model = ActorGPTModel(**kwargs)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    logger.info("built %s %s (%s spec, %s, %s attention, pre=%s post=%s): %s trainable, %s frozen params on this "
                "rank", role, spec.arch, "TE" if use_te else "local", config.params_dtype,
                config_attention_kernel(config), pre_process, post_process, f"{trainable:,}", f"{frozen:,}")
    return model
