"""Llama (LlamaForCausalLM): dense SwiGLU, no q/k norm, plain RoPE (scaled RoPE is refused by
`model_spec_from_hf`). Attention/MLP bias is refused there too."""

from megatron_sao.checkpoint.converters._common import RuleConverter, llama_family_rules

ARCH = "llama"
CONVERTER = RuleConverter(ARCH, llama_family_rules(qk_norm=False, dense_mlp=True))
hf_to_mcore = CONVERTER.hf_to_mcore
mcore_to_hf = CONVERTER.mcore_to_hf
