"""Qwen3 dense (Qwen3ForCausalLM): Llama layout plus per-head RMSNorm on q and k
(self_attn.q_norm / k_norm -> self_attention.q_layernorm / k_layernorm, weight [head_dim])."""

from megatron_sao.checkpoint.converters._common import RuleConverter, llama_family_rules

ARCH = "qwen3"
CONVERTER = RuleConverter(ARCH, llama_family_rules(qk_norm=True, dense_mlp=True))
hf_to_mcore = CONVERTER.hf_to_mcore
mcore_to_hf = CONVERTER.mcore_to_hf
