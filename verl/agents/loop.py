"""The agent loop: multi-turn episodes generated inside a rollout engine (`RolloutEngine.serve`).

    loop = AgentLoop(cfg.agent, engine.tokenizer, response_length=cfg.rollout.max_new_tokens)
    outputs, metrics = loop.rollout(engine, rows, sampling_params)      # n trajectories per row, prompt-major

Each trajectory is an environment episode. The engine generates a turn (until the template's end-of-turn token,
EOS, the turn's budget or the room left in the response); the turn goes to `env.step` on the loop's own event
loop thread, which runs its tool calls concurrently (a bounded pool, a timeout per call) while the engine goes on
generating every other trajectory; the observations come back as ids (`ChatFormat.observation_ids`) and the
trajectory is ready for its next turn. An episode ends when the environment says so, after agent.max_turns
turns, or when the response (rollout.max_new_tokens: every turn and observation after the prompt) is full —
an observation that does not fit ends it too, truncated and marked.

The output of a trajectory is one `GenerationOutput`: the prompt's ids, then the sampled ids and observation ids
in order (`loss_mask` 1 on sampled ones only), the rollout log-probs (0 on observations), its answer as `text`
and the environment's reward. Every trajectory passes the append-only check (`ChatFormat.check`) before it is
handed out; mismatches are counted (rollout/tito_mismatch) and the first few are explained on stderr.
"""

from __future__ import annotations

import asyncio
import random
import sys
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

from verl.agents.chat import ChatFormat, Check, Segment
from verl.agents.envs import Environment, StepResult, Turn, get_env
from verl.agents.formats import get_format
from verl.agents.tools import ToolRecord, ToolRunner, get_tool
from verl.errors import VerlConfigError, VerlRuntimeError
from verl.rollout.base import GenerationOutput, RolloutEngine, SamplingParams, TurnRequest
from verl.rollout.tokenizer import Tokenizer

__all__ = ["AgentLoop", "Trajectory"]


@dataclass(slots=True)
class Trajectory:
    """One episode's state and, when done, its record."""

    key: int
    prompt_index: int
    sample_index: int
    seed: int | None
    env: Environment
    messages: list[dict] | str
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    """The response so far: sampled and observation ids."""
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] | None = None
    segments: list[Segment] = field(default_factory=list)
    turns: int = 0
    reward: float = 0.0
    answer: str | None = None
    last_text: str = ""
    done: bool = False
    truncated: bool = False
    tool_calls: list[ToolRecord] = field(default_factory=list)
    check: Check | None = None
    check_s: float = 0.0

    def output(self) -> GenerationOutput:
        return GenerationOutput(prompt_index=self.prompt_index, sample_index=self.sample_index,
                                prompt_token_ids=list(self.prompt_ids), token_ids=list(self.ids),
                                text=self.answer if self.answer is not None else self.last_text,
                                finish_reason="length" if self.truncated else "stop",
                                logprobs=list(self.logprobs), token_versions=self.versions, loss_mask=list(self.mask),
                                reward=self.reward)


class _Runtime:
    """An asyncio event loop on a daemon thread: where environments step and tools run, beside the engine."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="verl-agent-tools", daemon=True)
        self.thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class AgentLoop:
    """Runs `cfg.env` episodes through an engine (module docstring). `response_length`: rollout.max_new_tokens,
    the room after the prompt for every turn and observation."""

    episodes: type = None  # type: ignore[assignment]  # set below: the TurnSource class (a benchmark swaps it)

    def __init__(self, cfg, tokenizer: Tokenizer, *, response_length: int):
        self.cfg, self.tok, self.response_length = cfg, Tokenizer.wrap(tokenizer), response_length
        self.env_cls = get_env(cfg.env)
        self.tools = {}
        for name in cfg.tools:
            tool = get_tool(name, **_settings(cfg, name))
            self.tools[tool.name] = tool
        unknown = sorted(set(cfg.tool_settings) - set(cfg.tools))
        if unknown:
            raise VerlConfigError(f"agent.tool_settings has settings for {unknown}, which are not in agent.tools="
                                  f"{list(cfg.tools)}")
        self.format = get_format(cfg.format)
        self.chat = ChatFormat(self.tok, tools=[t.schema() for t in self.tools.values()],
                               observation_role=self.format.observation_role)
        self.env_cls(**dict(cfg.env_settings))  # bad settings fail here, before any step
        self._runtime: _Runtime | None = None
        self._warned_rewrite = False
        self.record_spans = False
        """Record the next rollouts' timeline in `spans` (trainer.trace_step)."""
        self.spans: list[dict] = []

    def new_env(self) -> Environment:
        env = self.env_cls(**dict(self.cfg.env_settings))
        runner = ToolRunner(self.tools, timeout_s=self.cfg.tool_timeout_s,
                            max_concurrency=self.cfg.max_concurrent_tools)
        env.bind(self.tools, self.format, runner, describe_tools=not self.chat.native_tools)
        return env

    def prompt_ids(self, row: dict) -> list[int]:
        """The opening ids of an episode on `row` (what data.max_prompt_length is checked against)."""
        return self.chat.prompt_ids(_own(self.new_env().reset(row)))

    def trace_events(self, pid: int) -> list[dict]:
        """The recorded spans as Chrome trace events on process `pid`: one track per trajectory, its turns
        ("generate", from the engine taking it to the engine handing it back) and environment steps ("tools" /
        "env step", while its tool calls run), so that one trajectory's tools show beside the others' turns."""
        events = []
        for key in sorted({s["key"] for s in self.spans}):
            events.append({"name": "thread_name", "cat": "agent", "ph": "M", "ts": 0, "pid": pid, "tid": 100 + key,
                           "args": {"name": f"trajectory {key}"}})
        for s in self.spans:
            events.append({"name": s["name"], "cat": "agent", "ph": "X", "ts": s["start"] * 1e6,
                           "dur": (s["end"] - s["start"]) * 1e6, "pid": pid, "tid": 100 + s["key"],
                           "args": {"turn": s["turn"], **s.get("args", {})}})
        return events

    def close(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
            self._runtime = None

    # -- one rollout ---------------------------------------------------------------------------------------------
    def rollout(self, engine: RolloutEngine, rows: list[dict], params: SamplingParams,
                ) -> tuple[list[GenerationOutput], dict[str, float]]:
        """`params.n` trajectories per row (prompt-major, seeded like `generate`'s samples) and the step's agent
        metrics."""
        if self._runtime is None:
            self._runtime = _Runtime()
        params = self._turn_params(params)
        trajs = []
        for i, row in enumerate(rows):
            for j in range(params.n):
                env = self.new_env()
                messages = _own(env.reset(row))
                trajs.append(Trajectory(key=len(trajs), prompt_index=i, sample_index=j, seed=params.sample_seed(i, j),
                                        env=env, messages=messages, prompt_ids=self.chat.prompt_ids(messages),
                                        versions=[] if engine.pause_hook is not None else None))
        t0 = time.perf_counter()
        episodes = self.episodes(self, trajs, engine)
        engine.serve(episodes, params)
        episodes.raise_error()
        metrics = self._metrics(trajs, time.perf_counter() - t0)
        return [t.output() for t in trajs], metrics

    def _turn_params(self, params: SamplingParams) -> SamplingParams:
        import dataclasses
        stops = tuple(sorted(set(params.stop_token_ids) | set(self.chat.stop_ids)))
        return dataclasses.replace(params, stop_token_ids=stops, logprobs=True)

    def budget(self, traj: Trajectory) -> int:
        room = self.response_length - len(traj.ids)
        cap = self.cfg.max_tokens_per_turn or room
        return min(room, cap)

    # -- after a turn (on the runtime thread) --------------------------------------------------------------------
    async def advance(self, traj: Trajectory, out: GenerationOutput) -> None:
        """Appends a sampled turn, steps the environment and appends its observations (or ends the episode)."""
        start = len(traj.ids)
        traj.ids += out.token_ids
        traj.mask += [1] * len(out.token_ids)
        traj.logprobs += list(out.logprobs) if out.logprobs is not None else [0.0] * len(out.token_ids)
        if traj.versions is not None:
            traj.versions += list(out.token_versions or [-1] * len(out.token_ids))
        traj.segments.append(Segment("assistant", len(traj.prompt_ids) + start, len(traj.prompt_ids) + len(traj.ids),
                                     traj.turns))
        text = self.chat.turn_text(out.token_ids)
        if isinstance(traj.messages, list):
            traj.messages.append({"role": "assistant", "content": text})
        traj.last_text, traj.turns = text, traj.turns + 1
        room = self.response_length - len(traj.ids)
        last = traj.turns >= self.cfg.max_turns or room <= 1
        turn = Turn(text=text, token_ids=list(out.token_ids), index=traj.turns - 1, finish_reason=out.finish_reason,
                    last=last)
        try:
            result = await asyncio.wait_for(traj.env.step(turn), self.cfg.step_timeout_s)
        except asyncio.TimeoutError:
            raise VerlRuntimeError(f"environment {self.cfg.env!r} took longer than agent.step_timeout_s="
                                   f"{self.cfg.step_timeout_s:g} s in step {traj.turns - 1} of trajectory "
                                   f"{traj.key}") from None
        self._apply(traj, result, out, last)

    def _apply(self, traj: Trajectory, result: StepResult, out: GenerationOutput, last: bool) -> None:
        if not isinstance(result, StepResult):
            raise VerlRuntimeError(f"environment {self.cfg.env!r} step() returned {type(result).__name__}, not a "
                                   f"StepResult")
        traj.reward += float(result.reward)
        traj.tool_calls += result.tool_calls
        if result.answer is not None:
            traj.answer = result.answer
        if result.done or last:
            # truncated: the episode was cut (max_turns, or no room left in the response), not ended by the env
            traj.done, traj.truncated = True, not result.done
            return
        if isinstance(traj.messages, str):
            raise VerlRuntimeError(f"environment {self.cfg.env!r} returned observations for a plain-text prompt; "
                                   f"multi-turn episodes start from chat messages (reset() must return a list of "
                                   f"messages)")
        obs = self.chat.observation_ids(result.observations, out.token_ids[-1] if out.token_ids else None)
        if len(traj.ids) + len(obs) >= self.response_length:
            traj.truncated = traj.done = True  # the observation does not fit the response
            return
        start = len(traj.prompt_ids) + len(traj.ids)
        traj.ids += obs
        traj.mask += [0] * len(obs)
        traj.logprobs += [0.0] * len(obs)
        if traj.versions is not None:
            traj.versions += [-1] * len(obs)
        traj.segments.append(Segment("observation", start, start + len(obs), traj.turns - 1))
        traj.messages.extend(dict(m) for m in result.observations)

    def run_check(self, traj: Trajectory) -> None:
        t0 = time.perf_counter()
        if isinstance(traj.messages, list):
            segments = [Segment("prompt", 0, len(traj.prompt_ids), -1)] + traj.segments
            traj.check = self.chat.check(traj.messages, traj.prompt_ids + traj.ids, segments)
        else:
            traj.check = Check(ok=True)  # a text prompt and one sampled turn: nothing was appended
        traj.check_s = time.perf_counter() - t0

    # -- metrics -------------------------------------------------------------------------------------------------
    def _metrics(self, trajs: list[Trajectory], elapsed: float) -> dict[str, float]:
        n = max(1, len(trajs))
        calls = [c for t in trajs for c in t.tool_calls]
        response = sum(len(t.ids) for t in trajs)
        observed = sum(len(t.ids) - sum(t.mask) for t in trajs)
        turns = sum(t.turns for t in trajs)
        m = {"rollout/turns_mean": turns / n, "rollout/tool_calls_mean": len(calls) / n,
             "rollout/tool_use_rate": sum(bool(t.tool_calls) for t in trajs) / n,
             "rollout/observation_tokens_frac": observed / max(1, response),
             "rollout/truncated_frac": sum(t.truncated for t in trajs) / n,
             "rollout/tito_mismatch": sum(t.check is not None and not t.check.ok and not t.check.rewritten_only
                                          for t in trajs) / n,
             "rollout/env_reward_mean": sum(t.reward for t in trajs) / n,
             "perf/agent_rollout_s": elapsed,
             "perf/tito_check_ms_per_turn": 1e3 * sum(t.check_s for t in trajs) / max(1, turns)}
        if not self.chat.append_only:
            m["rollout/tito_rewritten"] = sum(t.check is not None and t.check.rewritten_only for t in trajs) / n
        bad = [c for c in calls if c.kind in ("bad_call", "unknown_tool")]
        m["rollout/bad_tool_calls_mean"] = len(bad) / n
        by_tool: dict[str, list[ToolRecord]] = defaultdict(list)
        for c in calls:
            if c.name in self.tools:
                by_tool[c.name].append(c)
        for name, recs in by_tool.items():
            m[f"tool/{name}/error_rate"] = sum(not r.ok for r in recs) / len(recs)
            m[f"tool/{name}/latency_s"] = sum(r.latency_s for r in recs) / len(recs)
            m[f"tool/{name}/calls_mean"] = len(recs) / n
        self._report(trajs)
        return m

    def _report(self, trajs: list[Trajectory]) -> None:
        """Explains the first mismatches (and the template's rewrite, once) on stderr."""
        shown = 0
        for t in trajs:
            if t.check is None or t.check.ok:
                continue
            if t.check.rewritten_only:
                if not self._warned_rewrite:
                    self._warned_rewrite = True
                    print(f"[verl] agent: the chat template is not append-only ({self.chat.rewrite}); trajectories "
                          f"keep every turn as generated and count the template's rewrite in rollout/tito_rewritten "
                          f"(docs/agents.md). First: trajectory {t.key}: {t.check.detail}", file=sys.stderr,
                          flush=True)
                continue
            if shown < self.cfg.log_mismatches:
                shown += 1
                print(f"[verl] agent: trajectory {t.key} (prompt {t.prompt_index}, sample {t.sample_index}) differs "
                      f"from the chat template's rendering of its conversation; trained as sampled. "
                      f"{t.check.detail}", file=sys.stderr, flush=True)


def _settings(cfg, name: str) -> dict:
    """A tool's constructor settings: agent.tool_settings.<name>, and agent.sandbox as `limits` for a sandboxed tool
    (whose sandbox must be able to start here: checked now, before any step)."""
    from verl.agents.tools import TOOLS
    settings = dict(cfg.tool_settings.get(name, {}))
    obj = TOOLS.get(name)
    if getattr(obj, "sandboxed", False) and "limits" not in settings:
        from verl.agents.sandbox import sandbox_available
        ok, why = sandbox_available(cfg.sandbox)
        if not ok:
            raise VerlConfigError(f"agent.tools has {name!r}, whose sandbox cannot start here: {why}")
        settings["limits"] = cfg.sandbox
    return settings


def _own(messages):
    """The trajectory's own copy of an environment's opening messages (a reset may hand out the data row's list,
    which the trajectory then appends to)."""
    if isinstance(messages, str):
        return messages
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise VerlRuntimeError(f"an environment's reset() returned {type(messages).__name__}; it returns chat "
                               f"messages (a list of dicts) or a text prompt")
    return [dict(m) for m in messages]


class _Episodes:
    """The `TurnSource` an engine serves: hands out ready turns, takes finished ones, steps environments on the
    runtime thread. Thread-safe: the engine calls take / finish / done, the runtime thread marks turns ready."""

    def __init__(self, loop: AgentLoop, trajs: list[Trajectory], engine: RolloutEngine):
        self.loop, self.trajs, self.engine = loop, trajs, engine
        self.cond = threading.Condition()
        self.ready: deque[int] = deque(t.key for t in trajs)
        self.pending = len(trajs)  # trajectories not finished and checked
        self.error: BaseException | None = None
        self.taken: dict[int, float] = {}  # when the engine took each trajectory's current turn (record_spans)

    def take(self, block: bool, limit: int | None = None) -> list[TurnRequest]:
        deadline = time.monotonic() + self.loop.cfg.step_timeout_s + 60
        with self.cond:
            while block and not self.ready and self.pending and self.error is None:
                if not self.cond.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic()))) and \
                        time.monotonic() > deadline:
                    raise VerlRuntimeError(f"no trajectory became ready within {self.loop.cfg.step_timeout_s + 60:g} "
                                           f"s while {self.pending} were waiting on their environments")
            self.raise_error()
            count = len(self.ready) if limit is None else min(limit, len(self.ready))
            keys = [self.ready.popleft() for _ in range(count)]
        if self.loop.record_spans:
            now = time.time()
            self.taken.update((k, now) for k in keys)
        return [self._request(self.trajs[k]) for k in keys]

    def _request(self, t: Trajectory) -> TurnRequest:
        return TurnRequest(key=t.key, prompt_ids=t.prompt_ids + t.ids, max_new_tokens=self.loop.budget(t),
                           seed=t.seed, turn=t.turns)

    def finish(self, request: TurnRequest, output: GenerationOutput) -> None:
        if self.loop.record_spans:
            self.loop.spans.append({"name": "generate", "key": request.key, "turn": request.turn,
                                    "start": self.taken.pop(request.key, time.time()), "end": time.time(),
                                    "args": {"tokens": len(output.token_ids)}})
        future = self.loop._runtime.submit(self._advance(self.trajs[request.key], output))
        future.add_done_callback(self._failed)

    async def _advance(self, traj: Trajectory, out: GenerationOutput) -> None:
        start, calls = time.time(), len(traj.tool_calls)
        await self.loop.advance(traj, out)
        if self.loop.record_spans:
            names = [c.name for c in traj.tool_calls[calls:]]
            self.loop.spans.append({"name": "tools: " + ", ".join(names) if names else "env step", "key": traj.key,
                                    "turn": traj.turns - 1, "start": start, "end": time.time(),
                                    "args": {"done": traj.done}})
        if traj.done:
            self.loop.run_check(traj)
        with self.cond:
            if traj.done:
                self.pending -= 1
            else:
                self.ready.append(traj.key)
            self.cond.notify_all()

    def _failed(self, future) -> None:
        exc = future.exception()
        if exc is not None:
            with self.cond:
                self.error = self.error or exc
                self.cond.notify_all()

    def done(self) -> bool:
        with self.cond:
            self.raise_error()
            return self.pending == 0

    def raise_error(self) -> None:
        if self.error is not None:
            err = self.error
            if isinstance(err, (VerlRuntimeError, VerlConfigError)):
                raise err
            raise VerlRuntimeError(f"environment {self.loop.cfg.env!r} failed: {type(err).__name__}: {err}",
                                   cause=err) from err


def demonstration_texts(loop: AgentLoop, rows: list[dict], seed: int) -> list[str]:
    """The rows' demonstrations rendered by the chat template (text a tokenizer can be trained on)."""
    rng = random.Random(seed)
    convs = (loop.new_env().demonstration(row, rng) for row in rows)
    return [loop.chat.render(c, add_generation_prompt=False) for c in convs if c is not None]


def demonstration_rows(loop: AgentLoop, rows: list[dict], seed: int) -> list[tuple[list[int], list[int]]]:
    """Warm-start data of an agent job: each row's `demonstration` (when its environment gives one) as (ids,
    labels mask) over the template, built the way rollouts build trajectories: assistant turns encoded and masked
    1, the template's deltas between them 0."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        env = loop.new_env()
        conv = env.demonstration(row, rng)
        if conv is None:
            continue
        out.append(_demo_ids(loop.chat, conv))
    return out


def _demo_ids(chat: ChatFormat, conv: list[dict]) -> tuple[list[int], list[int]]:
    first = next(i for i, m in enumerate(conv) if m["role"] == "assistant")
    ids = chat.prompt_ids(conv[:first])
    mask = [0] * len(ids)
    k = first
    while k < len(conv):
        turn = chat.encode(conv[k]["content"]) + ([chat.end_token] if chat.end_token is not None else [])
        ids += turn
        mask += [1] * len(turn)
        j = k + 1
        while j < len(conv) and conv[j]["role"] != "assistant":
            j += 1
        if j > k + 1:
            obs = chat.observation_ids(conv[k + 1:j], turn[-1])
            ids += obs
            mask += [0] * len(obs)
        k = j
    return ids, mask


AgentLoop.episodes = _Episodes
