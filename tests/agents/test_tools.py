"""Tools and the runner: the built-in tools, function tools, and every way a call can go wrong becoming an
observation plus a metric (never an exception)."""

from __future__ import annotations

import asyncio

import pytest

from verl.agents import FunctionTool, Tool, ToolCall, ToolResult, ToolRunner, get_tool, register_tool
from verl.agents.tools import TOOLS, calculate
from verl.errors import VerlConfigError


def run(coro):
    return asyncio.run(coro)


def test_calculator_is_exact_and_refuses_what_is_not_arithmetic():
    assert calculate("123456789 * 987654321") == str(123456789 * 987654321)
    assert calculate("(1 + 2) * 3 - 4 / 8") == "8.5"
    assert calculate("2 ** 10 // 3 % 7") == str(2 ** 10 // 3 % 7)
    for bad, why in (("__import__('os')", "unsupported"), ("1 / 0", "division"), ("2 ** 1000", "exponents"),
                     ("1 +", "not an arithmetic"), ("x" * 300, "longer")):
        with pytest.raises(ValueError, match=why):
            calculate(bad)
    result = run(get_tool("calculator").call({"expression": "1/0"}))
    assert not result.ok and "division" in result.text


def runner(**tools) -> ToolRunner:
    return ToolRunner(tools, timeout_s=0.2, max_concurrency=2)


class Boom(Tool):
    name, description = "boom", "raises"
    parameters = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}

    async def call(self, arguments):
        raise RuntimeError("kaput")


class Slow(Tool):
    name = "slow"
    parameters = {"type": "object", "properties": {}}

    async def call(self, arguments):
        await asyncio.sleep(5)
        return ToolResult(text="late")


@pytest.mark.parametrize("call, kind, text", [
    (ToolCall(name="calculater", arguments={"expression": "1"}), "unknown_tool", "did you mean 'calculator'"),
    (ToolCall(name="calculator", arguments={"expr": "1"}), "bad_arguments", "unknown argument 'expr'"),
    (ToolCall(name="calculator", arguments={}), "bad_arguments", "missing required argument 'expression'"),
    (ToolCall(name="calculator", arguments={"expression": 3}), "bad_arguments", "JSON type string"),
    (ToolCall(name="", error="the call is not valid JSON"), "bad_call", "invalid tool call"),
    (ToolCall(name="boom", arguments={"x": 1}), "raised", "RuntimeError: kaput"),
    (ToolCall(name="slow", arguments={}), "timeout", "timed out after 0.2 s"),
])
def test_every_failure_is_an_observation_and_a_record(call, kind, text):
    result, record = run(runner(calculator=get_tool("calculator"), boom=Boom(), slow=Slow()).run(call))
    assert not result.ok and text in result.text
    assert record.kind == kind and not record.ok


def test_the_runner_bounds_concurrency():
    state = {"now": 0, "peak": 0}

    class Counting(Tool):
        name = "count"
        parameters = {"type": "object", "properties": {}}

        async def call(self, arguments):
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
            await asyncio.sleep(0.01)
            state["now"] -= 1
            return ToolResult(text="ok")

    r = runner(count=Counting())

    async def many():
        return await asyncio.gather(*(r.run(ToolCall(name="count")) for _ in range(8)))
    out = run(many())
    assert all(res.ok for res, _ in out) and state["peak"] == 2


def test_function_tools_and_references():
    def add(a: int, b: int = 2) -> str:
        "Adds."
        return str(a + b)
    tool = FunctionTool(add)
    assert tool.parameters == {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                               "required": ["a"]}
    assert tool.schema()["function"]["description"] == "Adds."
    assert run(tool.call({"a": 1})).text == "3"
    ref = get_tool("tests.agents.test_tools:Boom")
    assert isinstance(ref, Boom)
    assert get_tool("sleep", latency_s=0.0).name == "sleep"
    with pytest.raises(VerlConfigError, match="does not take the settings"):
        get_tool("calculator", digits=3)
    with pytest.raises(VerlConfigError, match="already registered"):
        register_tool("calculator")(Boom)
    with pytest.raises(VerlConfigError, match="latency_s"):
        get_tool("sleep", latency_s=-1)
    assert "calculator" in TOOLS and "final_answer" in TOOLS
