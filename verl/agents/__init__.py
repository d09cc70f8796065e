"""Agentic rollouts: tools, environments and the multi-turn loop (see docs/agents.md)."""
