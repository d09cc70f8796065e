"""Tool-call formats: calls found in assistant text, and malformed ones reported (not raised)."""

from __future__ import annotations

from verl.agents import get_format


def test_hermes_parses_calls_and_reports_broken_ones():
    fmt = get_format("hermes")
    text = ('let me compute <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>\n'
            '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}\n</tool_call>')
    calls = fmt.parse(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("calculator", {"expression": "1+2"}, None),
                                                                ("search", {"query": "x"}, None)]
    assert fmt.parse("no calls here, the answer is 3") == []
    broken = fmt.parse('<tool_call>{"name": "calculator", "arguments": {</tool_call> <tool_call>{"name": "x"')
    assert [c.error is not None for c in broken] == [True, True]
    assert "not valid JSON" in broken[0].error and "not closed" in broken[1].error
    assert "must be a JSON object" in fmt.parse('<tool_call>{"name": "a", "arguments": [1]}</tool_call>')[0].error
    assert "unexpected keys" in fmt.parse('<tool_call>{"name": "a", "argumnts": {}}</tool_call>')[0].error
    call = fmt.call_text("calculator", {"expression": "1+2"})
    assert fmt.parse(call)[0].arguments == {"expression": "1+2"}


def test_json_format_is_llama3_style():
    fmt = get_format("json")
    assert fmt.observation_role == "ipython"
    (call,) = fmt.parse(' {"name": "calculator", "parameters": {"expression": "2*3"}}')
    assert call.name == "calculator" and call.arguments == {"expression": "2*3"}
    assert fmt.parse("The answer is 6.") == []
