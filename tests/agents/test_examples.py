"""The real-model agent example, CI-sized: examples/smollm2_gsm8k_tools.yaml (SmolLM2-135M-Instruct, the python
tool in its sandbox, up to 4 turns) for 2 steps; and the python tool itself inside an episode."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

from verl.agents import get_format, get_tool
from verl.agents.envs import ToolEnv, Turn
from verl.agents.tools import ToolRunner
from verl.trainer.main_ppo import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2_gsm8k_tools.yaml"
CI_SIZED = ["trainer.total_steps=2", "data.train_batch_size=2", "actor.mini_batch_size=2", "actor.micro_batch_size=4",
            "rollout.n=2", "rollout.max_new_tokens=96", "agent.max_tokens_per_turn=32", "data.num_examples=16",
            "trainer.save_final=false", "trainer.export_hf=false", "trainer.plot=false", "trainer.tensorboard=false",
            "trainer.progress_bar=false"]


def test_smollm2_gsm8k_tools_example_trains_two_steps(tmp_path, smollm2_dir):
    assert main([str(EXAMPLE), *CI_SIZED, f"trainer.output_dir={tmp_path}"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))
        assert 1 <= r["rollout/turns_mean"] <= 4 and 0 <= r["rollout/tito_mismatch"] <= 1
        assert 0 <= r["rollout/observation_tokens_frac"] < 1 and r["actor/grad_norm"] >= 0
        print(f"step {r['step']}: {r['perf/step_time_s']:.1f} s, reward {r['reward/mean']:.3f}, turns "
              f"{r['rollout/turns_mean']:.2f}, tool calls {r['rollout/tool_calls_mean']:.2f}")


def test_the_python_tool_in_an_episode_runs_in_the_sandbox():
    from verl.agents.sandbox import SandboxLimits
    tool = get_tool("python", limits=SandboxLimits(wall_s=5, output_bytes=256))
    env = ToolEnv()
    env.bind({"python": tool}, get_format("hermes"), ToolRunner({"python": tool}, timeout_s=20, max_concurrency=2),
             describe_tools=True)
    assert "python" in env.reset({"prompt": "what is 2**100?", "answer": ""})[0]["content"]
    call = get_format("hermes").call_text("python", {"code": "import os\nprint(2**100, os.getcwd())"})
    loop = get_format("hermes").call_text("python", {"code": "while True: pass"})
    step = asyncio.run(env.step(Turn(text=call + loop, token_ids=[], index=0, finish_reason="stop")))
    first, second = step.observations
    assert first["role"] == "tool" and first["content"].startswith(str(2 ** 100)) and "/tmp" in first["content"]
    assert "timeout" in second["content"] and not step.done
    assert [r.ok for r in step.tool_calls] == [True, False]
