"""Environments: one episode per prompt row (`agent.env`). `reset(sample)` gives the opening messages, then every
assistant turn goes to `step`, which returns the observation messages to append (tool results, a user's reply),
a reward and whether the episode is over.

    from verl.agents import Environment, StepResult, register_env

    @register_env("guess")
    class Guess(Environment):
        def reset(self, sample):
            self.target = int(sample["answer"])
            return [{"role": "user", "content": "Guess my number (1-100)."}]

        async def step(self, turn):
            guess = int(turn.text.strip() or 0)
            if guess == self.target:
                return StepResult(done=True, reward=1.0, answer=turn.text)
            return StepResult(observations=[{"role": "user", "content": "higher" if guess < self.target
                                             else "lower"}])

The loop makes one instance per trajectory (keyword settings from agent.env_settings) and gives it the run's tools,
tool-call format and tool runner (`self.tools`, `self.format`, `self.call_tools`) before `reset`. A single-turn
task is the environment whose first step is final (``single_turn``); ``tools`` is the general tool-using episode
and ``arithmetic_tools`` the default job's arithmetic with a calculator.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from verl.agents.formats import ToolFormat
from verl.agents.tools import Tool, ToolCall, ToolRecord, ToolRunner, calculate
from verl.registry import Registry

__all__ = ["ENVS", "ArithmeticToolEnv", "Environment", "SingleTurnEnv", "StepResult", "ToolEnv", "Turn", "get_env",
           "register_env"]


@dataclass(kw_only=True, slots=True)
class Turn:
    """One assistant turn as the engine sampled it."""

    text: str
    """Its text (special tokens kept, the final stop token left out)."""
    token_ids: list[int]
    """The sampled ids, stop token included."""
    index: int
    """0 for the first turn."""
    finish_reason: str
    """stop (the model ended the turn) or length (the turn's token budget ran out)."""
    last: bool = False
    """No further turn can follow (agent.max_turns reached, or no room left in rollout.max_new_tokens): the
    environment should not run tools whose results nobody will read, and should name the answer."""


@dataclass(kw_only=True, slots=True)
class StepResult:
    """What the environment says after a turn."""

    observations: list[dict] = field(default_factory=list)
    """Messages appended before the model's next turn (tool results, a user's reply)."""
    reward: float = 0.0
    """This step's reward; the trajectory's env reward is the sum (reward source type=env)."""
    done: bool = False
    """The episode is over (no further turn)."""
    answer: str | None = None
    """The trajectory's answer, what rule rewards score (default: the last turn's text)."""
    tool_calls: list[ToolRecord] = field(default_factory=list)
    """The calls this step made (metrics)."""


class Environment:
    """One episode (see the module docstring). Subclasses implement `reset` and `step`; `demonstration` is
    optional (the supervised warm start of an agent job trains on it)."""

    tools: dict[str, Tool]
    format: ToolFormat
    runner: ToolRunner | None
    describe_tools: bool
    """Whether `reset` should describe the tools in a system message (False when the chat template renders the
    schemas itself, from its ``tools`` argument)."""

    def __init__(self, **settings):
        if settings:
            raise TypeError(f"{type(self).__name__} takes no settings, got {sorted(settings)}")

    def bind(self, tools: dict[str, Tool], fmt: ToolFormat, runner: ToolRunner | None, describe_tools: bool) -> None:
        self.tools, self.format, self.runner, self.describe_tools = tools, fmt, runner, describe_tools

    def reset(self, sample: dict) -> list[dict] | str:
        """The opening messages of the episode for one data row ({"prompt", "answer"}); plain text for a prompt
        without a chat template (single-turn only)."""
        raise NotImplementedError

    async def step(self, turn: Turn) -> StepResult:
        raise NotImplementedError

    def demonstration(self, sample: dict, rng: random.Random) -> list[dict] | None:
        """A reference conversation for this row (assistant turns included), or None: the warm start's data."""
        return None

    async def call_tools(self, calls: list[ToolCall]) -> tuple[list[dict], list[ToolRecord], str | None]:
        """Runs `calls` concurrently (bounded by the runner); returns their result messages in call order, the
        records, and the answer of a final call (final_answer) if one was made."""
        results = await asyncio.gather(*(self.runner.run(c) for c in calls))
        messages = [self.format.observation(c, r.text) for c, (r, _) in zip(calls, results)]
        final = next((r.text for r, _ in results if r.final and r.ok), None)
        return messages, [rec for _, rec in results], final


ENVS: Registry = Registry("environment", key="agent.env", refs=True)
"""Environment classes by name."""


def register_env(name: str) -> Callable:
    """Decorator registering an Environment subclass under `name`."""
    return ENVS.register(name)


def get_env(name: str) -> type[Environment]:
    """The Environment class `name` names (registered, or ``module:Class``)."""
    from verl.errors import VerlConfigError
    cls = ENVS.get(name)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise VerlConfigError(f"agent.env={name!r} is {cls!r}, not an Environment subclass")
    return cls


def _user_messages(prompt) -> list[dict]:
    return [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


@register_env("single_turn")
class SingleTurnEnv(Environment):
    """The classic task: the row's prompt as it is (text or chat messages), one response, no tools."""

    def reset(self, sample: dict):
        return sample["prompt"]

    async def step(self, turn: Turn) -> StepResult:
        return StepResult(done=True)


@register_env("tools")
class ToolEnv(Environment):
    """A tool-using episode: the row's prompt as the user's message (chat prompts as given), the tools described in
    a system message (prepended, or added to the prompt's own); each turn's calls run concurrently and their results
    come back as the format's observation messages. A turn without calls, or a final_answer call, ends the episode;
    the answer is that turn's text, or final_answer's argument.

    Settings: `system_prompt` (text put before the tool description), `describe_tools` (false: no tool
    description, for models taught the convention by their warm start)."""

    def __init__(self, *, system_prompt: str | None = None, describe_tools: bool = True):
        self.system_prompt, self.want_description = system_prompt, describe_tools

    def reset(self, sample: dict) -> list[dict]:
        messages = _user_messages(sample["prompt"])
        parts = [self.system_prompt] if self.system_prompt else []
        if self.want_description and self.describe_tools and self.tools:
            parts.append(self.format.describe([t.schema() for t in self.tools.values()]))
        if parts:
            text = "\n\n".join(parts)
            if messages[0]["role"] == "system":
                messages[0]["content"] = messages[0]["content"] + "\n\n" + text
            else:
                messages.insert(0, {"role": "system", "content": text})
        return messages

    async def step(self, turn: Turn) -> StepResult:
        calls = self.format.parse(turn.text)
        if not calls:
            return StepResult(done=True, answer=turn.text)
        if turn.last:  # nobody would read the results
            final = next((c.arguments.get("answer") for c in calls if c.name == "final_answer" and c.error is None),
                         None)
            return StepResult(done=True, answer=None if final is None else str(final))
        messages, records, final = await self.call_tools(calls)
        if final is not None:
            return StepResult(done=True, answer=final, tool_calls=records)
        return StepResult(observations=messages, tool_calls=records)


@register_env("arithmetic_tools")
class ArithmeticToolEnv(ToolEnv):
    """The arithmetic task with a calculator: the prompt ``a+b=`` as the user's message, the answer the first number
    of the model's final turn (the ``arithmetic`` reward). Its warm-start demonstrations answer a share
    `demo_tool_rate` of the rows through the calculator (call, result, then the number) and the rest directly, so
    the warm-started policy knows the convention but rarely uses it: RL has to find out that it pays off."""

    def __init__(self, *, demo_tool_rate: float = 0.2, system_prompt: str | None = None,
                 describe_tools: bool = False):
        super().__init__(system_prompt=system_prompt, describe_tools=describe_tools)
        if not 0 <= demo_tool_rate <= 1:
            from verl.errors import VerlConfigError
            raise VerlConfigError(f"agent.env_settings.demo_tool_rate={demo_tool_rate} must be in [0, 1]")
        self.demo_tool_rate = demo_tool_rate

    def demonstration(self, sample: dict, rng: random.Random) -> list[dict]:
        messages = self.reset(sample)
        if rng.random() >= self.demo_tool_rate:
            return messages + [{"role": "assistant", "content": sample["answer"]}]
        expression = str(sample["prompt"]).rstrip("= ")
        call = self.format.call_text("calculator", {"expression": expression})
        result = calculate(expression)
        return messages + [{"role": "assistant", "content": call},
                           self.format.observation(ToolCall(name="calculator"), result),
                           {"role": "assistant", "content": result}]
