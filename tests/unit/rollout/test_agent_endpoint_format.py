"""The agent endpoint's message handling: canonical messages, tool calls in and out of Qwen3's and SmolLM2's
templates, and appended ids equal to the template's rendering of the whole conversation."""

from __future__ import annotations

import json

import pytest

from megatron_sao.rollout.agent_endpoint.messages import RequestError, canonical_messages, continues
from megatron_sao.rollout.agent_endpoint.tools import ToolFormat
from megatron_sao.rollout.chat import ChatFormatter
from megatron_sao.tokenizers import build_char_tokenizer
from tests.agent_endpoint_fixtures import BASH_TOOL, qwen3_tools_tokenizer, smollm2_tokenizer


def test_an_echoed_turn_is_the_same_message_whatever_the_client_adds():
    sent = canonical_messages([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]}])
    echoed = canonical_messages([{"role": "assistant", "content": "", "refusal": None, "function_call": None,
                                  "provider_specific_fields": {}, "tool_calls": [
        {"id": "renumbered", "type": "function", "function": {"name": "bash", "arguments": '{"command":"ls"}'}}]}])
    assert sent == echoed == [{"role": "assistant", "content": "", "tool_calls": [
        {"name": "bash", "arguments": {"command": "ls"}}]}]
    parts = canonical_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                                            "text": "b"}]}])
    assert parts == [{"role": "user", "content": "ab"}]
    assert canonical_messages([{"role": "developer", "content": "x"}]) == [{"role": "system", "content": "x"}]
    # an edited argument is a different turn
    edited = canonical_messages([{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "bash", "arguments": '{"command": "ls -la"}'}}]}])
    assert edited != sent


def test_continues_only_when_the_history_is_unchanged_and_the_tail_is_not_the_assistant_s():
    h = canonical_messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
    tool = {"role": "tool", "content": "out", "tool_call_id": "c"}
    assert continues(h, h + canonical_messages([tool])) == canonical_messages([tool])
    assert continues(h, h) is None  # nothing new
    assert continues(h, canonical_messages([{"role": "user", "content": "q2"}, h[1], tool])) is None  # edited
    assert continues(h, h[:1] + canonical_messages([tool])) is None  # the assistant turn dropped
    assert continues(h, h + canonical_messages([{"role": "assistant", "content": "b"}])) is None


@pytest.mark.parametrize("bad, match", [
    ([], "non-empty list"), ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text parts"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]}], r"tool_calls\[0\]"),
])
def test_bad_messages_are_refused_naming_the_field(bad, match):
    with pytest.raises(RequestError, match=match):
        canonical_messages(bad)


def test_tool_calls_are_parsed_out_of_the_model_s_text():
    text = 'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    content, calls = ToolFormat.parse(text)
    assert content == "Let me look." and len(calls) == 1
    assert calls[0]["function"] == {"name": "bash", "arguments": json.dumps({"command": "ls"})}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    # a malformed block stays text: the harness sees what the model wrote
    bad = "<tool_call>{not json}</tool_call>"
    assert ToolFormat.parse(bad) == (bad, [])
    assert ToolFormat.parse("no call") == ("no call", [])


def _conversation(calls_native: bool):
    call = {"role": "assistant", "content": "I will list.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}]}
    return [{"role": "system", "content": "Fix bugs."}, {"role": "user", "content": "The test fails."}, call,
            {"role": "tool", "tool_call_id": "c1", "content": "a.py"}]


@pytest.mark.parametrize("which", ["qwen3", "smollm2"])
def test_appended_ids_equal_the_template_s_rendering_of_the_whole_conversation(which, tmp_path):
    """What the endpoint appends turn by turn is what the template renders for the whole conversation, for
    Qwen3's native tool layout and for SmolLM2's plain ChatML (tools written into the messages)."""
    tok = qwen3_tools_tokenizer() if which == "qwen3" else smollm2_tokenizer(tmp_path)
    f = ChatFormatter(tok)
    tf = ToolFormat(f)
    assert tf.native == (which == "qwen3")
    conv = canonical_messages(_conversation(tf.native))
    rendered, extra = tf.template_messages(conv[:2], [BASH_TOOL])
    prompt = f.prompt_ids(rendered, **extra)
    text = tok.decode(prompt)
    assert '"name": "bash"' in text and "<tools>" in text  # the tool list reached the model
    # the model's turn: its text as the template writes an assistant tool call, then the stop id
    [assistant] = tf.template_messages(conv[:3], None)[0][2:]
    if tf.native:
        action_text = tok.apply_chat_template([{"role": "user", "content": "x"}, assistant], tokenize=False)
        action_text = action_text.split("<|im_start|>assistant\n", 1)[1].rsplit("<|im_end|>", 1)[0]
    else:
        action_text = assistant["content"]
    action = tok.encode(action_text, add_special_tokens=False) + [f.stop_token_ids[-1]]
    obs = f.continuation_ids(tf.continuation(conv[3:]), action)
    ids = prompt + action + obs
    whole_msgs, whole_extra = tf.template_messages(conv, [BASH_TOOL])
    whole = tok.encode(f.render(whole_msgs, add_generation_prompt=True, **whole_extra), add_special_tokens=False)
    assert ids == whole
    # and the parser reads the call back out of the model's text
    content, calls = ToolFormat.parse(action_text)
    assert content == "I will list." and json.loads(calls[0]["function"]["arguments"]) == {"command": "ls"}


def test_a_template_without_tool_support_gets_tools_in_its_system_message():
    f = ChatFormatter(build_char_tokenizer())
    tf = ToolFormat(f)
    assert not tf.native
    msgs, extra = tf.template_messages(canonical_messages([{"role": "user", "content": "hi"}]), [BASH_TOOL])
    assert extra == {} and msgs[0]["role"] == "system" and "<tools>" in msgs[0]["content"]
    msgs, _ = tf.template_messages(canonical_messages([{"role": "system", "content": "S"},
                                                       {"role": "user", "content": "hi"}]), [BASH_TOOL])
    assert msgs[0]["content"].startswith("S\n\n# Tools") and len(msgs) == 2
    assert tf.continuation(canonical_messages([{"role": "tool", "content": "out"}])) == [
        {"role": "tool", "content": "<tool_response>\nout\n</tool_response>"}]
