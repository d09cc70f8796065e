"""Agentic rollouts: tools, environments and the multi-turn loop (see docs/agents.md).

    from verl.agents import get_tool, get_env, register_tool, register_env, Tool, ToolResult, Environment

Registries (names or ``module:attr`` references in the config): tools (`agent.tools`), environments
(`agent.env`), tool-call formats (`agent.format`). The loop (`AgentLoop`) runs episodes inside the rollout
engines, token-in-token-out (`ChatFormat`).
"""

from verl.agents.chat import ChatFormat, Check
from verl.agents.envs import ENVS, Environment, StepResult, Turn, get_env, register_env
from verl.agents.formats import FORMATS, ToolFormat, get_format, register_format
from verl.agents.tools import TOOLS, FunctionTool, Tool, ToolCall, ToolResult, ToolRunner, get_tool, register_tool

__all__ = ["ChatFormat", "Check", "ENVS", "Environment", "FORMATS", "FunctionTool", "StepResult", "TOOLS", "Tool",
           "ToolCall", "ToolFormat", "ToolResult", "ToolRunner", "Turn", "get_env", "get_format", "get_tool",
           "register_env", "register_format", "register_tool"]
