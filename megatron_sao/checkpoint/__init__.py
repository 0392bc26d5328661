"""HF <-> Megatron-Core mapping (also used by the engine's weight export), sharding rules,
HF safetensors I/O, the megatron-sao sharded checkpoint format and offline conversion.

Entry points: `converters.get_converter`, `sharding` (RankLayout, shard/unshard, name offsets),
`load.load_hf_into_model` / `load.load_megatron_checkpoint_into_model`,
`convert.convert_hf_to_megatron` / `convert.convert_megatron_to_hf`.
"""
