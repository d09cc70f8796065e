"""Tools: what an agent's environment lets the model call, chosen by name (`agent.tools`), and the runner that calls
them concurrently with a bounded pool and a per-call timeout.

    from verl.agents import Tool, ToolResult, register_tool

    @register_tool("weather")                        # a plain function: its signature is the JSON schema
    async def weather(city: str) -> str:
        "Today's weather in a city."
        return "sunny"

    @register_tool("lookup")                         # or a Tool subclass with its own settings
    class Lookup(Tool):
        name, description = "lookup", "Looks a word up."
        parameters = {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}
        async def call(self, arguments: dict) -> ToolResult:
            return ToolResult(text=arguments["word"].upper())

`agent.tools=[calculator, final_answer, python, my_pkg.tools:lookup]`: registered names, or ``module:attr``
references (a Tool subclass, a Tool instance or a function), which torchrun-spawned processes import alike.

Built-in tools: ``calculator`` (exact integer / decimal arithmetic on an expression), ``final_answer`` (ends the
episode with its argument as the answer; environments read it), ``python`` (code in the sandbox of
`verl.agents.sandbox`, limits from agent.sandbox), ``sleep`` (waits a given time and echoes its argument: the
latency of `verl bench agent`).

Nothing a tool does can crash a run: an unknown tool, arguments the schema rejects, a tool that raises or runs past
agent.tool_timeout_s all become an error observation the model reads (`ToolResult(ok=False)`) and a metric.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import math
import operator
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation, localcontext

from verl.errors import VerlConfigError, nearest
from verl.registry import Registry

__all__ = ["FunctionTool", "TOOLS", "Tool", "ToolCall", "ToolRecord", "ToolResult", "ToolRunner", "get_tool",
           "register_tool"]


@dataclass(kw_only=True, slots=True)
class ToolResult:
    """What one tool call returns."""

    text: str
    """The observation the model reads."""
    ok: bool = True
    """False: the call failed (the text says why); counted in tool/<name>/error_rate."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Numbers of the tool's own (logged as tool/<name>/<key>, averaged over the step's calls)."""
    final: bool = False
    """The call ends the episode (final_answer): `text` is the trajectory's answer."""


@dataclass(kw_only=True, slots=True)
class ToolCall:
    """One call the model wrote, as the tool-call format parsed it."""

    name: str
    """The tool's name ('' when the call could not be parsed)."""
    arguments: dict = field(default_factory=dict)
    """The call's arguments."""
    error: str | None = None
    """Why the call is not valid (bad JSON, not an object, ...): the model gets this as its observation."""
    call_id: str | None = None
    """An id the format assigned, echoed in the tool message (formats whose templates want one)."""


@dataclass(kw_only=True, slots=True)
class ToolRecord:
    """What a call cost and how it ended: the step's tool metrics come from these."""

    name: str
    ok: bool
    latency_s: float
    kind: str = "ok"
    """ok, error (the tool said so), raised, timeout, bad_arguments, unknown_tool, bad_call."""
    metrics: dict[str, float] = field(default_factory=dict)


class Tool:
    """A callable the model can use. Subclasses set `name`, `description`, `parameters` (a JSON schema of an object)
    and implement `async call(arguments) -> ToolResult`; `__init__` keyword arguments are its settings."""

    name: str = ""
    description: str = ""
    parameters: dict = {"type": "object", "properties": {}}

    async def call(self, arguments: dict) -> ToolResult:
        raise NotImplementedError

    def schema(self) -> dict:
        """The OpenAI-style function schema chat templates and tool-call formats render."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def check_arguments(self, arguments) -> str | None:
        """Why `arguments` do not fit `parameters` (unknown or missing keys, wrong JSON types), or None."""
        if not isinstance(arguments, dict):
            return f"arguments must be a JSON object, got {type(arguments).__name__}"
        props = self.parameters.get("properties", {})
        unknown = [k for k in arguments if k not in props]
        if unknown:
            return f"unknown argument {unknown[0]!r}{nearest(unknown[0], props, 'arguments')}"
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            return f"missing required argument {missing[0]!r}"
        for key, value in arguments.items():
            want = props[key].get("type")
            if want is not None and not _json_type_ok(value, want):
                return f"argument {key!r} must be of JSON type {want}, got {json.dumps(value)[:40]}"
        return None


_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "object": (dict,), "array": (list,), "null": (type(None),)}


def _json_type_ok(value, want) -> bool:
    kinds = want if isinstance(want, list) else [want]
    for kind in kinds:
        types = _JSON_TYPES.get(kind)
        if types is None:
            return True  # a schema type this check does not know: the tool checks it itself
        if isinstance(value, types) and not (kind in ("integer", "number") and isinstance(value, bool)):
            return True
    return False


_PY_TO_JSON = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


class FunctionTool(Tool):
    """A plain function (sync or async) as a tool: keyword parameters with str / int / float / bool / dict / list
    hints become the JSON schema (those without a default are required), its docstring the description. It returns
    a str (the observation) or a ToolResult; sync functions run in a worker thread."""

    def __init__(self, fn: Callable, name: str | None = None):
        self.fn, self.name = fn, name or fn.__name__
        self.description = inspect.getdoc(fn) or ""
        props, required = {}, []
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            hint = p.annotation if p.annotation is not p.empty else str
            hint = eval(hint, fn.__globals__) if isinstance(hint, str) else hint  # noqa: S307 - the function's own hint
            props[p.name] = {"type": _PY_TO_JSON.get(hint, "string")}
            if p.default is p.empty:
                required.append(p.name)
        self.parameters = {"type": "object", "properties": props, "required": required}

    async def call(self, arguments: dict) -> ToolResult:
        if inspect.iscoroutinefunction(self.fn):
            out = await self.fn(**arguments)
        else:
            out = await asyncio.to_thread(self.fn, **arguments)
        return out if isinstance(out, ToolResult) else ToolResult(text=str(out))


TOOLS: Registry = Registry("tool", key="agent.tools", refs=True)
"""Tools by name: Tool subclasses (built with their settings), Tool instances or functions."""


def register_tool(name: str) -> Callable:
    """Decorator registering a Tool subclass, a Tool instance or a function under `name`."""
    return TOOLS.register(name)


def get_tool(name: str, **settings) -> Tool:
    """The tool `name` names (registered, or ``module:attr``), built with `settings` (a Tool subclass's __init__
    keywords; other kinds take none)."""
    obj = TOOLS.get(name)
    if isinstance(obj, type) and issubclass(obj, Tool):
        try:
            tool = obj(**settings)
        except TypeError as e:
            raise VerlConfigError(f"tool {name!r} does not take the settings {sorted(settings)} "
                                  f"(agent.tool_settings.{name}): {e}") from e
    elif settings:
        raise VerlConfigError(f"tool {name!r} takes no settings (agent.tool_settings.{name}={settings})")
    elif isinstance(obj, Tool):
        tool = obj
    elif callable(obj):
        tool = FunctionTool(obj, name=name.rpartition(":")[2].rpartition(".")[2])
    else:
        raise VerlConfigError(f"agent.tools: {name!r} is {type(obj).__name__}, not a Tool, Tool subclass or function")
    if not tool.name:
        raise VerlConfigError(f"tool {name!r} ({type(tool).__name__}) has no name; set its `name` attribute")
    return tool


class ToolRunner:
    """Calls tools for the environments of one rollout: at most `max_concurrency` calls at once over every
    trajectory, each bounded by `timeout_s`; every outcome is a ToolResult plus a ToolRecord."""

    def __init__(self, tools: Mapping[str, Tool], *, timeout_s: float, max_concurrency: int):
        self.tools, self.timeout_s = dict(tools), timeout_s
        self.max_concurrency = max_concurrency
        self._sem: asyncio.Semaphore | None = None

    async def run(self, call: ToolCall) -> tuple[ToolResult, ToolRecord]:
        if self._sem is None:  # created on the event loop that runs the calls
            self._sem = asyncio.Semaphore(self.max_concurrency)
        if call.error is not None:
            return _failed(call.name or "?", f"invalid tool call: {call.error}", "bad_call", 0.0)
        tool = self.tools.get(call.name)
        if tool is None:
            return _failed(call.name, f"unknown tool {call.name!r}{nearest(call.name, self.tools, 'tools')}",
                           "unknown_tool", 0.0)
        bad = tool.check_arguments(call.arguments)
        if bad is not None:
            return _failed(call.name, f"invalid arguments for {call.name}: {bad}", "bad_arguments", 0.0)
        async with self._sem:
            t0 = time.perf_counter()
            try:
                result = await asyncio.wait_for(tool.call(call.arguments), self.timeout_s)
            except asyncio.TimeoutError:
                return _failed(call.name, f"tool {call.name} timed out after {self.timeout_s:g} s", "timeout",
                               time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - a tool's failure is the model's observation, never the run's
                return _failed(call.name, f"tool {call.name} failed: {type(e).__name__}: {e}", "raised",
                               time.perf_counter() - t0)
            latency = time.perf_counter() - t0
        if not isinstance(result, ToolResult):
            return _failed(call.name, f"tool {call.name} returned {type(result).__name__}, not a ToolResult",
                           "raised", latency)
        return result, ToolRecord(name=call.name, ok=result.ok, latency_s=latency,
                                  kind="ok" if result.ok else "error", metrics=dict(result.metrics))


def _failed(name: str, text: str, kind: str, latency: float) -> tuple[ToolResult, ToolRecord]:
    return ToolResult(text=text, ok=False), ToolRecord(name=name, ok=False, latency_s=latency, kind=kind)


# -- built-in tools ----------------------------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate(node: ast.AST, digits: int) -> Decimal:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, digits)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Decimal(str(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand, digits))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, digits), _evaluate(node.right, digits)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or right != right.to_integral_value()):
            raise ValueError("exponents must be integers of at most 64")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element {type(node).__name__}; use numbers, + - * / // % ** and ()")


def calculate(expression: str, digits: int = 28) -> str:
    """The exact value of an arithmetic expression (integers stay integers; decimals to `digits` significant
    digits), or raises ValueError saying what is wrong."""
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None
    with localcontext() as ctx:
        ctx.prec = digits
        try:
            value = _evaluate(tree, digits)
        except (ZeroDivisionError, InvalidOperation):
            raise ValueError("division by zero or an undefined result") from None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


@register_tool("calculator")
class Calculator(Tool):
    """Exact arithmetic: + - * / // % ** and parentheses on integers and decimals."""

    name = "calculator"
    description = "Evaluates an arithmetic expression exactly (+ - * / // % ** and parentheses)."
    parameters = {"type": "object", "properties": {"expression": {"type": "string",
                                                                  "description": "e.g. 1234 + 5678"}},
                  "required": ["expression"]}

    async def call(self, arguments: dict) -> ToolResult:
        try:
            return ToolResult(text=calculate(arguments["expression"]))
        except ValueError as e:
            return ToolResult(text=f"error: {e}", ok=False)


@register_tool("final_answer")
class FinalAnswer(Tool):
    """Ends the episode: its `answer` argument is the trajectory's answer (what the reward scores)."""

    name = "final_answer"
    description = "Gives the final answer and ends the task."
    parameters = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}

    async def call(self, arguments: dict) -> ToolResult:
        return ToolResult(text=str(arguments["answer"]), final=True)


@register_tool("sleep")
class Sleep(Tool):
    """Waits `latency_s` (a setting) and echoes its `text` argument: a tool of known latency, for benchmarks."""

    name = "sleep"
    description = "Waits, then repeats the text it was given."
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

    def __init__(self, latency_s: float = 0.0):
        if not 0 <= latency_s < math.inf:
            raise VerlConfigError(f"agent.tool_settings.sleep.latency_s={latency_s} must be a finite number >= 0")
        self.latency_s = float(latency_s)

    async def call(self, arguments: dict) -> ToolResult:
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        return ToolResult(text=str(arguments["text"]))


@register_tool("python")
class PythonTool(Tool):
    """Runs Python code in the sandbox of `verl.agents.sandbox` (its own namespaces, no network, a fresh /tmp,
    CPU / memory / file / process limits, a wall-clock kill, output cut at a size); the model reads its output, or
    a one-line reason (timeout, memory limit, ...). Limits: agent.sandbox."""

    name = "python"
    description = "Runs a Python program and returns what it prints (print the values you need)."
    parameters = {"type": "object", "properties": {"code": {"type": "string", "description": "a Python program"}},
                  "required": ["code"]}
    sandboxed = True
    """The loop gives it agent.sandbox as `limits` and checks up front that the sandbox can start here."""

    def __init__(self, limits=None):
        from verl.agents.sandbox import SandboxLimits
        self.limits = limits if limits is not None else SandboxLimits()

    async def call(self, arguments: dict) -> ToolResult:
        from verl.agents.sandbox import run_python_async
        result = await run_python_async(arguments["code"], self.limits)
        return ToolResult(text=result.observation(), ok=result.ok,
                          metrics={"sandbox_s": result.wall_s, "truncated": float(result.truncated)})
