"""ChatFormatter: token-append chat handling equals the template's rendering (no re-tokenization drift)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from megatron_sao.rollout.chat import ChatFormatter, ChatTemplateError
from megatron_sao.tokenizers import build_char_tokenizer, char_token_id
from tests.unit.rollout.test_agent_loop_fakes import QWEN3_QUIRKS_TEMPLATE, QWEN_SHAPE_TEMPLATE, qwen_shape_tokenizer

CHAR = build_char_tokenizer()
END = char_token_id(CHAR, "<|end|>")
CONVERSATION = [
    {"role": "user", "content": "3*4+5"},
    {"role": "assistant", "content": "CALL 3*4"},
    {"role": "tool", "content": "12"},
    {"role": "assistant", "content": "CALL 12+5"},
    {"role": "tool", "content": "17"},
    {"role": "assistant", "content": "ANS 17"},
]


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def append_only_ids(f: ChatFormatter, tok, conversation, stop_id: int) -> list[int]:
    """Build ids as the agent loop does: prompt, then sampled ids (content + stop id), then observations."""
    ids = f.prompt_ids(conversation[:1])
    action: list[int] = []
    for m in conversation[1:]:
        if m["role"] == "assistant":
            action = enc(tok, m["content"]) + [stop_id]
            ids += action
        else:
            ids += f.observation_ids(m["role"], m["content"], action)
    return ids


def test_char_formatter_pieces():
    f = ChatFormatter(CHAR)
    assert f.stop_token_ids == (CHAR.eos_token_id, END)
    assert f.closing_ids == [END]
    assert CHAR.decode(f.prompt_ids(CONVERSATION[:1])) == "<|user|>3*4+5<|end|><|assistant|>"
    action = enc(CHAR, "CALL 3*4") + [END]
    assert CHAR.decode(f.observation_ids("tool", "12", action)) == "<|tool|>12<|end|><|assistant|>"
    # a turn cut by the token limit did not sample <|end|>: the template's closing is added
    assert CHAR.decode(f.observation_ids("tool", "12", action[:-1])) == "<|end|><|tool|>12<|end|><|assistant|>"
    assert f.action_text(action) == "CALL 3*4"
    assert f.action_text(action[:-1]) == "CALL 3*4"


def test_char_append_only_ids_equal_full_template_rendering():
    f = ChatFormatter(CHAR)
    ids = append_only_ids(f, CHAR, CONVERSATION, END)
    assert ids == enc(CHAR, CHAR.apply_chat_template(CONVERSATION, tokenize=False))


def test_qwen_shape_append_only_ids_equal_full_template_rendering():
    tok = qwen_shape_tokenizer(QWEN_SHAPE_TEMPLATE)
    f = ChatFormatter(tok)
    im_end = char_token_id(tok, "<|im_end|>")
    assert f.stop_token_ids == (tok.eos_token_id, im_end)
    assert f.closing_ids == [im_end, char_token_id(tok, "\n")]
    ids = append_only_ids(f, tok, CONVERSATION, im_end)
    full = enc(tok, tok.apply_chat_template(CONVERSATION, tokenize=False))
    # The template writes "\n" after the final <|im_end|>; the policy stops at <|im_end|> itself.
    assert ids + [char_token_id(tok, "\n")] == full
    # and mid-conversation, with the next generation prompt
    ids_mid = append_only_ids(f, tok, CONVERSATION[:3], im_end)
    assert ids_mid == enc(tok, tok.apply_chat_template(CONVERSATION[:3], tokenize=False, add_generation_prompt=True))


@pytest.mark.parametrize("thinking", [None, False])
def test_qwen3_quirks_template_suffix_is_cut_after_the_content(thinking):
    tok = qwen_shape_tokenizer(QWEN3_QUIRKS_TEMPLATE)
    kw = {} if thinking is None else {"enable_thinking": thinking}
    f = ChatFormatter(tok, template_kwargs=kw)
    # The naive two-render diff breaks on this template: the last assistant turn renders differently.
    short = tok.apply_chat_template(CONVERSATION[:2], tokenize=False, **kw)
    longer = tok.apply_chat_template(CONVERSATION[:3], tokenize=False, add_generation_prompt=True, **kw)
    assert not longer.startswith(short)
    gen = "<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if thinking is False else "")
    action = enc(tok, "CALL 3*4<|im_end|>")
    obs = tok.decode(f.observation_ids("tool", "12", action))
    assert obs == "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n" + gen
    assert tok.decode(f.prompt_ids(CONVERSATION[:1])) == "<|im_start|>user\n3*4+5<|im_end|>\n" + gen


def test_user_role_observation():
    tok = qwen_shape_tokenizer(QWEN_SHAPE_TEMPLATE)
    f = ChatFormatter(tok)
    action = enc(tok, "hello<|im_end|>")
    assert tok.decode(f.observation_ids("user", "again", action)) == \
        "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"


def test_encode_demonstration_matches_rollout_layout():
    f = ChatFormatter(CHAR)
    ids, mask = f.encode_demonstration(CONVERSATION)
    assert ids == enc(CHAR, CHAR.apply_chat_template(CONVERSATION, tokenize=False))
    sampled = [t for t, m in zip(ids, mask) if m]
    assert CHAR.decode(sampled) == "CALL 3*4<|end|>CALL 12+5<|end|>ANS 17<|end|>"
    with pytest.raises(ValueError, match="end with an assistant"):
        f.encode_demonstration(CONVERSATION[:3])
    with pytest.raises(ValueError, match="must follow an assistant"):
        f.encode_demonstration(CONVERSATION[:2] + [CONVERSATION[2], CONVERSATION[2], CONVERSATION[3]])


def test_bad_inputs_give_clear_errors():
    f = ChatFormatter(CHAR)
    with pytest.raises(ValueError, match="non-empty list"):
        f.prompt_ids([])
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        f.prompt_ids([{"role": "user"}])
    with pytest.raises(ValueError, match="was not probed"):
        f.observation_ids("system", "x", [END])
    with pytest.raises(TypeError, match="must be a str"):
        f.observation_ids("tool", None, [END])
    with pytest.raises(ValueError, match="template_kwargs must not set"):
        ChatFormatter(CHAR, template_kwargs={"add_generation_prompt": True})
    with pytest.raises(ValueError, match="extra_stop_token_ids"):
        ChatFormatter(CHAR, extra_stop_token_ids=(10_000,))
    with pytest.raises(ChatTemplateError, match="unknown role"):
        f.prompt_ids([{"role": "robot", "content": "x"}])


def test_unusable_templates_are_rejected_at_construction():
    tok = build_char_tokenizer()
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatFormatter(tok)
    with pytest.raises(ChatTemplateError, match="does not render assistant content"):
        ChatFormatter(CHAR, chat_template="{% for m in messages %}{{ m.role }}{% endfor %}")
    drops_tool = "{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}|{% endif %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="drops the content"):
        ChatFormatter(CHAR, chat_template=drops_tool)


def _word_tokenizer() -> PreTrainedTokenizerFast:
    """Whitespace word-level tokenizer: text glued to the previous turn merges into one (unknown) word."""
    core = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "<eos>": 1, "0": 2}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>")


def test_strict_mode_detects_merges_across_the_turn_boundary():
    glued = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="merge across the turn boundary"):
        ChatFormatter(_word_tokenizer(), chat_template=glued)
    f = ChatFormatter(_word_tokenizer(), chat_template=glued, strict=False)
    assert f.observation_ids("tool", "0", [1]) == [2]


def test_sao_eval_on_a_model_without_a_chat_template_is_one_line_naming_it(tmp_path, capsys):
    """A base model's tokenizer (no chat template) given to a command is the user's to fix: exit 2, one
    line naming the tokenizer and what to do, no traceback."""
    from megatron_sao.cli import main
    from tests.engine_fixtures import make_tiny_model

    model = make_tiny_model(tmp_path, "dense")
    config = Path(__file__).resolve().parents[2] / "e2e" / "tiny_ci.yaml"
    assert main(["eval", str(config), "--checkpoint", str(model), f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert f"'{model}' has no chat template" in err and "model.tokenizer" in err and "Traceback" not in err
