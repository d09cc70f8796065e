"""Multi-turn rollouts with a tool of known latency: tokens/s with the agent loop inside the engine (trajectories
waiting on a tool leave the batch, the others keep generating) against the same job turn by turn in lockstep
(every trajectory waits for the slowest tool before anyone starts the next turn), side by side.

The job: the tiny Llama of verl.models.tiny with the torch engine (fast decoder, continuous batching), --trajectories
episodes of --turns turns; every turn but the last calls the `sleep` tool (agent.tool_settings.sleep.latency_s) through
the loop's tool runner, whatever the model wrote; turns end at one of a few stop tokens or at --turn-tokens, so their
lengths vary as real turns do. With --latency-dist exp every call waits an exponential time of the latency's mean
instead (drawn from the trajectory and turn, the same on both sides): real tools vary, and lockstep then waits for
the slowest call of each turn. With a fixed latency L the loop can gain at most 2x over lockstep: lockstep takes
G + (T - 1) L (G: the generation, T turns) and the loop at least max(G, (T - 1) L). Each latency is run with both
schedules, alternately, --rounds times (the latencies'
order rotating from round to round; the median is reported); the work is equal (same seeds, same turns, same
tokens).

    verl bench agent                                 # latencies 0, 50 ms, 500 ms (beside bench_sandbox.py)
    python benchmarks/agent/bench_agent.py --trajectories 128 --rounds 1
    python benchmarks/agent/bench_agent.py --latency-dist exp --out benchmarks/results/bench_agent_exp.json

Writes benchmarks/results/bench_agent.json (meta.command) and prints the table: per latency and schedule, step time,
sampled tokens/s, the ratio to the 0-latency step of the same schedule and, for the loop, its speed-up over lockstep;
and the tool path: the longest total time one trajectory waits on its own tools, below which no schedule's step can
go (with exponential latencies of mean 500 ms, the slowest of 128 trajectories waits about 3 s over two calls).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from verl.agents import Environment, StepResult, Tool, ToolCall, ToolResult, register_env, register_tool  # noqa: E402
from verl.agents.loop import AgentLoop, _Episodes  # noqa: E402
from verl.config.ppo import AgentConfig, TinyModelConfig  # noqa: E402
from verl.rollout import RolloutConfig, SamplingParams, build_rollout  # noqa: E402
from verl.models.tiny import tiny_model, tiny_tokenizer  # noqa: E402


@register_tool("bench_sleep_exp")
class ExponentialSleep(Tool):
    """Waits an exponentially distributed time of mean `latency_s` (as real tools vary: a search, a test run),
    drawn from a hash of its `text` argument (trajectory and turn), so both schedules wait the same times."""

    name = "bench_sleep_exp"
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

    def __init__(self, latency_s: float = 0.0):
        self.latency_s = float(latency_s)

    async def call(self, arguments: dict) -> ToolResult:
        await asyncio.sleep(exp_latency(self.latency_s, arguments["text"]))
        return ToolResult(text="ok")


def exp_latency(mean: float, text: str) -> float:
    u = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") / 2**64
    return -mean * math.log1p(-u)


def tool_path_s(args, latency: float) -> float:
    """The longest time one trajectory spends waiting on its own tools: no schedule's step can be shorter."""
    if args.latency_dist == "fixed":
        return (args.turns - 1) * latency
    return max(sum(exp_latency(latency, f"task {i} turn {t}") for t in range(args.turns - 1))
               for i in range(args.trajectories))


@register_env("bench_sleep")
class SleepToolEnv(Environment):
    """Every turn but the last calls the sleep tool (as if the model had); the model's text is not read."""

    def __init__(self, turns: int = 3, tool: str = "sleep"):
        self.turns, self.tool, self.task = turns, tool, ""

    def reset(self, sample):
        self.task = sample["prompt"]
        return [{"role": "user", "content": sample["prompt"]}]

    async def step(self, turn):
        if turn.index + 1 >= self.turns:
            return StepResult(done=True)
        call = ToolCall(name=self.tool, arguments={"text": f"{self.task} turn {turn.index}"})
        messages, records, _ = await self.call_tools([call])
        return StepResult(observations=messages, tool_calls=records)


class LockstepEpisodes(_Episodes):
    """Turn by turn: turns are handed out only when every unfinished trajectory is ready, so each turn starts
    after the slowest tool of the previous one (and generation waits for all of them)."""

    def take(self, block: bool, limit: int | None = None):
        with self.cond:
            while self.pending and len(self.ready) < self.pending and self.error is None:
                if not block:
                    return []
                self.cond.wait(0.5)
        return super().take(block, limit)


def run_once(engine, tok, args, latency: float, lockstep: bool) -> dict:
    tool = "sleep" if args.latency_dist == "fixed" else "bench_sleep_exp"
    cfg = AgentConfig(env="bench_sleep", env_settings={"turns": args.turns, "tool": tool}, tools=[tool],
                      tool_settings={tool: {"latency_s": latency}}, max_turns=args.turns,
                      max_tokens_per_turn=args.turn_tokens, max_concurrent_tools=args.trajectories, log_mismatches=0)
    loop = AgentLoop(cfg, tok, response_length=args.turns * (args.turn_tokens + 16))
    if lockstep:
        loop.episodes = LockstepEpisodes
    rows = [{"prompt": f"task {i}", "answer": ""} for i in range(args.trajectories)]
    stops = tuple(range(10, 10 + args.stop_tokens))  # a few ordinary tokens end a turn: lengths vary
    params = SamplingParams(max_new_tokens=args.turn_tokens, n=1, temperature=1.0, seed=7, logprobs=True,
                            stop_token_ids=stops)
    t0 = time.perf_counter()
    outs, metrics = loop.rollout(engine, rows, params)
    elapsed = time.perf_counter() - t0
    loop.close()
    sampled = sum(sum(o.loss_mask) for o in outs)
    return {"latency_s": latency, "schedule": "lockstep" if lockstep else "agent_loop", "step_s": elapsed,
            "sampled_tokens": sampled, "tokens_per_s": sampled / elapsed,
            "turns_mean": metrics["rollout/turns_mean"], "tool_latency_s": metrics.get("tool/sleep/latency_s", 0.0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latencies", type=float, nargs="+", default=[0.0, 0.05, 0.5])
    ap.add_argument("--trajectories", type=int, default=256)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=48)
    ap.add_argument("--stop-tokens", type=int, default=2, help="ordinary token ids that end a turn (length spread)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--latency-dist", choices=("fixed", "exp"), default="fixed",
                    help="every tool call waits the latency (fixed) or an exponential time of that mean (exp)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_agent.json"))
    args = ap.parse_args()
    from verl.utils.results import RunInfo
    args.run = RunInfo.start()
    torch.set_num_threads(args.threads)
    tok = tiny_tokenizer(chat="chatml")
    model = tiny_model(TinyModelConfig(max_position_embeddings=512), tokenizer=tok, seed=0)
    engine = build_rollout(RolloutConfig(engine="torch", max_batch_size=args.trajectories), model=model,
                           tokenizer=tok)
    run_once(engine, tok, args, 0.0, False)  # warm-up (allocator, first-call costs), not reported
    runs = []
    for r in range(args.rounds):
        # latencies rotate from round to round, schedules alternate: a drift of the machine's load spreads over all
        for latency in args.latencies[r % len(args.latencies):] + args.latencies[:r % len(args.latencies)]:
            for lockstep in ((False, True) if r % 2 == 0 else (True, False)):
                res = run_once(engine, tok, args, latency, lockstep)
                runs.append({**res, "round": r})
                print(f"round {r} latency {latency:g}s {res['schedule']:10s} {res['step_s']:.2f} s "
                      f"{res['tokens_per_s']:.0f} tok/s", flush=True)
    table = []
    for latency in args.latencies:
        for schedule in ("agent_loop", "lockstep"):
            mine = [x for x in runs if x["latency_s"] == latency and x["schedule"] == schedule]
            table.append({"latency_s": latency, "schedule": schedule,
                          "step_s": statistics.median(x["step_s"] for x in mine),
                          "tokens_per_s": statistics.median(x["tokens_per_s"] for x in mine),
                          "sampled_tokens": mine[0]["sampled_tokens"], "turns_mean": mine[0]["turns_mean"],
                          "tool_path_s": tool_path_s(args, latency)})
    base = {s: next(t["step_s"] for t in table if t["schedule"] == s and t["latency_s"] == args.latencies[0])
            for s in ("agent_loop", "lockstep")}
    for t in table:
        t["step_vs_first_latency"] = t["step_s"] / base[t["schedule"]]
        if t["schedule"] == "agent_loop":
            lock = next(x for x in table if x["schedule"] == "lockstep" and x["latency_s"] == t["latency_s"])
            t["speedup_vs_lockstep"] = lock["step_s"] / t["step_s"]
    print(f"\n{'latency':>8} {'schedule':>11} {'step s':>8} {'tok/s':>8} {'vs 0-lat':>9} {'vs lockstep':>12} "
          f"{'tool path s':>12}")
    for t in table:
        print(f"{t['latency_s']:>8g} {t['schedule']:>11} {t['step_s']:>8.2f} {t['tokens_per_s']:>8.0f} "
              f"{t['step_vs_first_latency']:>9.2f} {t.get('speedup_vs_lockstep', float('nan')):>12.2f} "
              f"{t['tool_path_s']:>12.2f}")
    meta = {"machine": platform.machine(), "torch": torch.__version__, "trajectories": args.trajectories,
            "turns": args.turns, "turn_tokens": args.turn_tokens, "latency_dist": args.latency_dist,
            "rounds": args.rounds, "threads": args.threads,
            "note": "one process; sampled tokens per wall-clock second of the whole rollout; both schedules run "
                    "the same seeded turns, alternately, on a machine shared with other jobs"}
    from verl.utils.results import write_result
    write_result(args.out, {"meta": meta, "rows": table, "runs": runs}, args.run)
    print(f"wrote {os.path.relpath(args.out, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
