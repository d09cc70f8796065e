"""Tool-call formats: how a chat format's model calls tools and reads their results (`agent.format`).

A format says three things: how the tools are described to the model (a system-prompt text, for chat templates
that do not render a ``tools`` argument themselves), how calls are found in the text of an assistant turn, and in
which role the results come back.

``hermes`` (the default; ChatML models such as SmolLM2 and Qwen): a call is a JSON object inside
``<tool_call>...</tool_call>`` tags, any number per turn::

    <tool_call>{"name": "calculator", "arguments": {"expression": "1234+5678"}}</tool_call>

and each result is a message of role ``tool`` (rendered by the chat template: ChatML's ``<|im_start|>tool``
turn, Qwen's ``<tool_response>`` inside a user turn).

``json`` (Llama-3-style): the whole assistant turn is one JSON object ``{"name": ..., "parameters": {...}}``; the
result comes back in role ``ipython``.

Register your own with `register_format` (a `ToolFormat` subclass); ``module:Class`` references work too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from verl.agents.tools import ToolCall
from verl.registry import Registry

__all__ = ["FORMATS", "HermesFormat", "JsonFormat", "ToolFormat", "get_format", "register_format"]


class ToolFormat:
    """One tool-calling convention (see the module docstring)."""

    name: str = ""
    observation_role: str = "tool"
    """The role of a tool result message."""

    def describe(self, schemas: list[dict]) -> str:
        """System-prompt text that tells the model which tools exist and how to call them."""
        raise NotImplementedError

    def parse(self, text: str) -> list[ToolCall]:
        """The calls in an assistant turn's text (empty: the turn calls nothing, it answers)."""
        raise NotImplementedError

    def call_text(self, name: str, arguments: dict) -> str:
        """The text of a call as the model should write it (warm-start demonstrations)."""
        raise NotImplementedError

    def observation(self, call: ToolCall, text: str) -> dict:
        """The message that carries one call's result."""
        return {"role": self.observation_role, "content": text}


def _call_from_json(raw: str, args_key: str) -> ToolCall:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCall(name="", error=f"the call is not valid JSON ({e.msg} at character {e.pos}): {raw[:80]!r}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(name="", error=f'a call is a JSON object {{"name": ..., "{args_key}": {{...}}}}, got '
                                       f"{raw[:80]!r}")
    args = obj.get(args_key, {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return ToolCall(name=obj["name"], error=f'"{args_key}" must be a JSON object, got {json.dumps(args)[:80]}')
    extra = sorted(set(obj) - {"name", args_key})
    if extra:
        return ToolCall(name=obj["name"], error=f"unexpected keys {extra} in the call (only name and {args_key})")
    return ToolCall(name=obj["name"], arguments=args)


class HermesFormat(ToolFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; results in role ``tool``."""

    name = "hermes"
    _CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def describe(self, schemas: list[dict]) -> str:
        lines = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
        return ("You can call tools. Their signatures, one JSON schema per line:\n<tools>\n" + lines +
                "\n</tools>\nTo call one, write its name and arguments as a JSON object inside <tool_call></tool_call>"
                ' tags, e.g. <tool_call>{"name": "a_tool", "arguments": {"x": 1}}</tool_call>. Its result comes back'
                " in a tool message.")

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for m in self._CALL.finditer(text):
            if not m.group(2):
                calls.append(ToolCall(name="", error="<tool_call> is not closed by </tool_call>"))
            else:
                calls.append(_call_from_json(m.group(1).strip(), "arguments"))
        return calls

    def call_text(self, name: str, arguments: dict) -> str:
        return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "</tool_call>"


class JsonFormat(ToolFormat):
    """Llama-3-style: the turn is one JSON object ``{"name": ..., "parameters": {...}}``; results in role
    ``ipython``. A turn that does not start with ``{`` is an answer."""

    name = "json"
    observation_role = "ipython"

    def describe(self, schemas: list[dict]) -> str:
        lines = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
        return ("To call a function, answer with only a JSON object of the form "
                '{"name": function name, "parameters": {argument: value}}. Functions:\n' + lines)

    def parse(self, text: str) -> list[ToolCall]:
        body = text.strip()
        if not body.startswith("{"):
            return []
        return [_call_from_json(body, "parameters")]

    def call_text(self, name: str, arguments: dict) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


FORMATS: Registry = Registry("tool-call format", key="agent.format", refs=True)
FORMATS.add("hermes", HermesFormat)
FORMATS.add("json", JsonFormat)


def register_format(name: str) -> Callable:
    """Decorator registering a ToolFormat subclass under `name`."""
    return FORMATS.register(name)


def get_format(name: str) -> ToolFormat:
    """An instance of the format `name` names (registered, or ``module:Class``)."""
    obj = FORMATS.get(name)
    return obj() if isinstance(obj, type) else obj
