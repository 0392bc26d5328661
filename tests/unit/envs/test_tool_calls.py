"""Parsing of tool calls and final answers."""

from megatron_sao.envs.tool_calls import extract_boxed, extract_python_block, format_tool_response, parse_tool_calls


def test_hermes_json_tool_call():
    text = 'Let me compute.\n<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>'
    (call,) = parse_tool_calls(text)
    assert call.ok and call.name == "python" and call.arguments == {"code": "print(6*7)"}


def test_relaxed_python_tag_and_order():
    text = '<python>print(1)</python> then <tool_call>{"name": "python", "arguments": {"code": "print(2)"}}</tool_call>'
    calls = parse_tool_calls(text)
    assert [c.arguments["code"] for c in calls] == ["print(1)", "print(2)"]


def test_arguments_given_as_json_string():
    (call,) = parse_tool_calls('<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"x=1\\"}"}</tool_call>')
    assert call.ok and call.arguments == {"code": "x=1"}


def test_unterminated_call_at_end_is_accepted():
    (call,) = parse_tool_calls('<tool_call>{"name": "python", "arguments": {"code": "print(3)"}}')
    assert call.ok and call.arguments["code"] == "print(3)"


def test_malformed_calls_are_reported_not_raised():
    bad_json, no_name, bad_args = parse_tool_calls(
        "<tool_call>{name: python}</tool_call><tool_call>{\"arguments\": {}}</tool_call>"
        '<tool_call>{"name": "python", "arguments": [1]}</tool_call>')
    assert "not valid JSON" in bad_json.error
    assert "missing a string 'name'" in no_name.error
    assert "must be a JSON object" in bad_args.error


def test_no_tool_call():
    assert parse_tool_calls("The answer is \\boxed{3}.") == []


def test_boxed_extraction():
    assert extract_boxed("so \\boxed{\\frac{1}{2}} and finally \\boxed{70}") == "70"
    assert extract_boxed("\\boxed{\\sqrt{a_{1}}}") == "\\sqrt{a_{1}}"
    assert extract_boxed("no answer here") is None
    assert extract_boxed("\\boxed{unclosed") is None
    # inside a reasoning block only the part after </think> counts
    assert extract_boxed("<think>maybe \\boxed{1}</think>It is \\boxed{2}") == "2"
    assert extract_boxed("<think>maybe \\boxed{1}</think>I am unsure") is None


def test_python_block_extraction():
    text = "draft:\n```python\nx = 1\n```\nfinal:\n```python\ndef f():\n    return 2\n```"
    assert extract_python_block(text) == "def f():\n    return 2\n"
    assert extract_python_block("no code") is None


def test_tool_response_format():
    assert format_tool_response("42") == "<tool_response>\n42\n</tool_response>"
