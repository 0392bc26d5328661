"""HF <-> Megatron conversion: bit-exact round trips, layout slicing, errors, atomic output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_sao.checkpoint.convert import convert_hf_to_megatron, convert_megatron_to_hf
from megatron_sao.checkpoint.hf_io import HFCheckpointReader, is_weight_file
from megatron_sao.checkpoint.megatron_format import MegatronCheckpointReader
from tests.integration.megatron.workers.models_hf_dirs import make_hf_dirs
from tests.paths import REPO

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return make_hf_dirs(str(tmp_path_factory.mktemp("hf")))


def _tensors(d) -> dict[str, torch.Tensor]:
    reader = HFCheckpointReader(d)
    return {k: reader[k] for k in reader}


def _assert_same_checkpoint(orig, back):
    a, b = _tensors(orig), _tensors(back)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    extra = sorted(f for f in os.listdir(orig) if not is_weight_file(f))
    assert extra == sorted(f for f in os.listdir(back) if not is_weight_file(f))
    for f in extra:  # config, generation config and tokenizer files byte for byte
        with open(os.path.join(orig, f), "rb") as x, open(os.path.join(back, f), "rb") as y:
            assert x.read() == y.read(), f


@pytest.mark.parametrize("arch,layout", [("qwen3_moe", (1, 1, 1)), ("qwen3_moe", (2, 2, 2)), ("qwen3", (2, 2, 1)),
                                         ("llama", (1, 1, 1)), ("llama", (2, 2, 1))])
def test_actor_round_trip_bit_exact(hf, tmp_path, arch, layout):
    tp, pp, ep = layout
    mg = convert_hf_to_megatron(hf[arch], tmp_path / "mg", tp=tp, pp=pp, ep=ep, progress=False)
    meta = json.loads((mg / "megatron_sao_checkpoint.json").read_text())
    # etp unset: the trainer's rule (experts whole when ep >= tp), written into the metadata
    assert meta["parallel"] == {"tp": tp, "pp": pp, "ep": ep, "etp": 1 if ep >= tp else tp} and meta["role"] == "actor"
    back = convert_megatron_to_hf(mg, tmp_path / "back", progress=False)
    _assert_same_checkpoint(hf[arch], back)


def test_critic_round_trip_and_actor_to_critic(hf, tmp_path):
    mg = convert_hf_to_megatron(hf["qwen3_critic"], tmp_path / "mg", tp=2, pp=2, role="critic", progress=False)
    _assert_same_checkpoint(hf["qwen3_critic"], convert_megatron_to_hf(mg, tmp_path / "back", progress=False))
    # An actor checkpoint as critic: lm_head dropped, zero value head, token-classification config.
    mg2 = convert_hf_to_megatron(hf["llama"], tmp_path / "mg2", role="critic", value_head_init="zero", progress=False)
    back = _tensors(convert_megatron_to_hf(mg2, tmp_path / "back2", progress=False))
    assert "lm_head.weight" not in back and back["score.weight"].shape == (1, 64)
    assert torch.count_nonzero(back["score.weight"]) == 0 and torch.equal(back["score.bias"], torch.zeros(1))
    cfg = json.loads((tmp_path / "back2" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForTokenClassification"] and len(cfg["id2label"]) == 1


def test_layout_slicing_tp2_pp2_ep2(hf, tmp_path):
    mg = convert_hf_to_megatron(hf["qwen3_moe"], tmp_path / "mg", tp=2, pp=2, ep=2, etp=1, progress=False)
    src = _tensors(hf["qwen3_moe"])
    # stage 1 holds global layer 1; TP rank 1 holds the second query group of qkv, interleaved [q_g; k_g; v_g].
    dense = load_file(str(mg / "pp_001" / "tp_01.safetensors"))
    qkv = dense["decoder.layers.1.self_attention.linear_qkv.weight"]
    p = "model.layers.1.self_attn."
    assert torch.equal(qkv, torch.cat([src[p + "q_proj.weight"][32:], src[p + "k_proj.weight"][16:],
                                       src[p + "v_proj.weight"][16:]]))
    assert torch.equal(dense["decoder.layers.1.self_attention.linear_proj.weight"], src[p + "o_proj.weight"][:, 32:])
    # vocab 128 is padded to 256 rows at TP 2 (a multiple of 128 * TP): rank 1 holds padding only.
    assert torch.equal(dense["output_layer.weight"], torch.zeros(128, 64))
    dense0 = load_file(str(mg / "pp_001" / "tp_00.safetensors"))
    assert torch.equal(dense0["output_layer.weight"], src["lm_head.weight"])
    assert "embedding.word_embeddings.weight" not in dense and not any(".layers.0." in k for k in dense)
    # EP rank 1 of stage 0 holds experts 2 and 3 of layer 0, whole (etp=1), fc1 = [gate; up].
    experts = load_file(str(mg / "pp_000" / "ep_001_etp_00.safetensors"))
    assert sorted({k.split(".")[6] for k in experts}) == ["2", "3"]
    fc1 = experts["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]
    e = "model.layers.0.mlp.experts.3."
    assert torch.equal(fc1, torch.cat([src[e + "gate_proj.weight"], src[e + "up_proj.weight"]]))
    assert not (mg / "pp_000" / "ep_001_etp_01.safetensors").exists()
    # with etp=2 rank 1's fc1 shard is [gate_1; up_1], not a slice of [gate; up].
    mg2 = convert_hf_to_megatron(hf["qwen3_moe"], tmp_path / "mg2", tp=2, ep=2, etp=2, progress=False)
    fc1_r1 = load_file(str(mg2 / "pp_000" / "ep_001_etp_01.safetensors"))[
        "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert torch.equal(fc1_r1, torch.cat([src[e + "gate_proj.weight"][16:], src[e + "up_proj.weight"][16:]]))
    reader = MegatronCheckpointReader(mg2)
    assert torch.equal(reader.full_tensor("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"), fc1)


@pytest.fixture(scope="module")
def hf_v50257(tmp_path_factory):
    """GPT-2's vocabulary size (odd: no TP divides it): an untied Llama and a tied Qwen3, 4 KV heads."""
    from megatron_sao.models.presets import tiny_hf_config, tiny_hf_model

    root = tmp_path_factory.mktemp("hf_v50257")
    out = {}
    for i, arch in enumerate(("llama", "qwen3")):
        cfg = tiny_hf_config(arch, vocab_size=50257, num_key_value_heads=4, num_hidden_layers=2)
        tiny_hf_model(cfg, seed=10 + i).save_pretrained(root / arch)
        out[arch] = root / arch
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_50257_round_trip_padded_as_megatron(hf_v50257, tmp_path, arch, tp):
    """Vocab 50257 at TP 1/2/4: shards hold padded_vocab_size(50257, tp) rows (50304 / 50432 / 50688,
    Megatron-LM's multiple of 128 * tp) with zero padding on the last rank; back to HF bit for bit."""
    padded = {1: 50304, 2: 50432, 4: 50688}[tp]
    mg = convert_hf_to_megatron(hf_v50257[arch], tmp_path / "mg", tp=tp, progress=False)
    shards = [load_file(str(mg / "pp_000" / f"tp_{r:02d}.safetensors")) for r in range(tp)]
    src = _tensors(hf_v50257[arch])
    heads = ["embedding.word_embeddings.weight"] + ([] if arch == "qwen3" else ["output_layer.weight"])
    for name in heads:
        rows = [sh[name] for sh in shards]
        assert all(r.shape == (padded // tp, 64) for r in rows), name
        full = torch.cat(rows)
        hf_name = "model.embed_tokens.weight" if name.startswith("embedding") else "lm_head.weight"
        assert torch.equal(full[:50257], src[hf_name]) and not full[50257:].any(), name
    assert MegatronCheckpointReader(mg).full_tensor("embedding.word_embeddings.weight").shape == (50257, 64)
    _assert_same_checkpoint(hf_v50257[arch], convert_megatron_to_hf(mg, tmp_path / "back", progress=False))


def test_vocab_shard_from_another_vocab_is_named(hf_v50257):
    from megatron_sao.checkpoint.sharding import RankLayout, shard_tensor
    from megatron_sao.models.hf_config import model_spec_from_hf

    spec = model_spec_from_hf(hf_v50257["llama"])
    with pytest.raises(ValueError, match=r"embedding\.word_embeddings\.weight has 50256 vocabulary rows"):
        shard_tensor("embedding.word_embeddings.weight", torch.zeros(50256, 64), RankLayout(tp=2, tp_rank=0), spec)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _no_leftovers(parent, name):
    assert not (parent / name).exists()
    assert [p for p in os.listdir(parent) if p.startswith(f".{name}.tmp")] == []


def test_missing_tensor_named_and_no_partial_output(hf, tmp_path):
    bad = _copy(hf["qwen3_moe"], tmp_path / "bad")
    state = load_file(str(bad / "model.safetensors"))
    del state["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight"):
        convert_hf_to_megatron(bad, tmp_path / "out", tp=2, progress=False)
    _no_leftovers(tmp_path, "out")


def test_shape_mismatch_named_mid_conversion_leaves_nothing(hf, tmp_path):
    bad = _copy(hf["llama"], tmp_path / "bad")
    state = load_file(str(bad / "model.safetensors"))
    state["model.layers.3.mlp.down_proj.weight"] = state["model.layers.3.mlp.down_proj.weight"][:, :-1].contiguous()
    save_file(state, str(bad / "model.safetensors"))
    # The bad tensor sits on the last stage: stage 0 is already written when it fails.
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.down_proj\.weight"):
        convert_hf_to_megatron(bad, tmp_path / "out", pp=2, progress=False)
    _no_leftovers(tmp_path, "out")


def test_unsupported_arch_and_bad_layout(hf, tmp_path):
    bad = _copy(hf["llama"], tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, model_type="gpt2")))
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        convert_hf_to_megatron(bad, tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        convert_hf_to_megatron(hf["llama"], tmp_path / "out", tp=4, progress=False)
    _no_leftovers(tmp_path, "out")


def test_existing_out_dir_needs_overwrite(hf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="overwrite"):
        convert_hf_to_megatron(hf["qwen3"], out, progress=False)
    assert (out / "keep.txt").read_text() == "x"
    convert_hf_to_megatron(hf["qwen3"], out, overwrite=True, progress=False)
    assert not (out / "keep.txt").exists() and (out / "megatron_sao_checkpoint.json").is_file()


def test_hf_writer_shards_with_index(hf, tmp_path):
    mg = convert_hf_to_megatron(hf["qwen3_moe"], tmp_path / "mg", progress=False)
    back = convert_megatron_to_hf(mg, tmp_path / "back", max_shard_bytes=20_000, progress=False)
    index = json.loads((back / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((back / f).is_file() for f in files)
    _assert_same_checkpoint(hf["qwen3_moe"], back)


@pytest.mark.slow
def test_cli_reports_error_and_exit_code(hf, tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "convert_megatron_to_hf.py"),
                           "--megatron-dir", str(tmp_path / "nope"), "--out-dir", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2 and "not a megatron-sao checkpoint" in proc.stderr, proc.stderr[-2000:]
    _no_leftovers(tmp_path, "out")
