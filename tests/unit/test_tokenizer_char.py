"""The CPU demo's character tokenizer: vocabulary, round trips, chat template, save/load."""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from megatron_sao.tokenizers import SPECIAL_TOKENS, build_char_tokenizer, char_token_id, save_char_tokenizer
from megatron_sao.tokenizers.char_tokenizer import CHARACTERS

TOK = build_char_tokenizer()
PRINTABLE = st.text(alphabet=CHARACTERS, max_size=60)


def test_vocab_layout_is_small_and_stable():
    assert len(TOK) <= 128
    assert TOK.pad_token_id == 0 and TOK.eos_token_id == 1 and TOK.unk_token_id == 2
    for i, s in enumerate(SPECIAL_TOKENS):
        assert TOK.convert_tokens_to_ids(s) == i
    # every printable ASCII character and \t \n is one distinct id right after the specials
    ids = [TOK.convert_tokens_to_ids(c) for c in string.printable if c not in "\r\x0b\x0c"]
    assert len(set(ids)) == len(ids) and min(ids) == len(SPECIAL_TOKENS)


@settings(max_examples=60, deadline=None)
@given(PRINTABLE)
def test_one_id_per_character_and_exact_round_trip(text):
    ids = TOK.encode(text, add_special_tokens=False)
    assert TOK.decode(ids) == text
    if not any(s in text for s in SPECIAL_TOKENS):  # a special token's text encodes to its one id
        assert len(ids) == len(text)


def test_special_tokens_are_atomic_and_unknown_characters_map_to_unk():
    ids = TOK.encode("<|user|>a b<|end|>é", add_special_tokens=False)
    assert ids == [char_token_id(TOK, "<|user|>"), char_token_id(TOK, "a"), char_token_id(TOK, " "),
                   char_token_id(TOK, "b"), char_token_id(TOK, "<|end|>"), TOK.unk_token_id]
    assert TOK.decode(ids, skip_special_tokens=True) == "a b"
    with pytest.raises(KeyError, match="not in the char tokenizer"):
        char_token_id(TOK, "<|nope|>")


def test_chat_template_is_compact():
    msgs = [{"role": "user", "content": "3*4+5"}, {"role": "assistant", "content": "CALL 3*4"},
            {"role": "tool", "content": "12"}]
    text = TOK.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>3*4+5<|end|><|assistant|>CALL 3*4<|end|><|tool|>12<|end|><|assistant|>"


def test_chat_template_rejects_unknown_roles():
    with pytest.raises(Exception, match="unknown role"):
        TOK.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_save_and_load_round_trip(tmp_path):
    save_char_tokenizer(tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    text = "<|user|>12+7<|end|><|assistant|>ANS 19<|end|>"
    assert loaded.encode(text, add_special_tokens=False) == TOK.encode(text, add_special_tokens=False)
    assert loaded.chat_template == TOK.chat_template
    assert (loaded.pad_token_id, loaded.eos_token_id, len(loaded)) == (0, 1, len(TOK))
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    # portable to loaders that do not know transformers 5.x's "TokenizersBackend" class name
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == TOK.chat_template


def test_save_refuses_a_file_path(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError):
        save_char_tokenizer(tmp_path / "f")


def test_extra_special_tokens_are_appended_and_validated():
    tok = build_char_tokenizer(["<|im_start|>", "<|im_end|>"])
    assert tok.convert_tokens_to_ids("<|im_end|>") == len(tok) - 1
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [len(tok) - 1]
    with pytest.raises(ValueError, match="repeat"):
        build_char_tokenizer(["<|end|>"])
    with pytest.raises(ValueError, match="2\\+ characters"):
        build_char_tokenizer(["x"])
    with pytest.raises(ValueError, match="limit is 128"):
        build_char_tokenizer([f"<t{i}>" for i in range(30)])


def test_incremental_detokenization_matches_full_decode():
    """vLLM's streaming detokenizer (tokenizers.DecodeStream) must agree with a full decode."""
    from tokenizers.decoders import DecodeStream

    ids = TOK.encode("<|assistant|>CALL 3*4\n ok<|end|>", add_special_tokens=False)
    for skip in (True, False):
        stream = DecodeStream(skip_special_tokens=skip)
        pieces = [stream.step(TOK.backend_tokenizer, i) for i in ids]
        assert "".join(p or "" for p in pieces) == TOK.decode(ids, skip_special_tokens=skip)
