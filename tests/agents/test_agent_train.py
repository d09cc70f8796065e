"""`verl train` with agent.env: the agent_arithmetic example, CI-sized, trains on batches whose trained tokens are
exactly the sampled ones; the same job under torchrun with the rollout on its own rank in async mode; the config
errors of the agent section."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl.agents.loop import _Episodes
from verl.config import PPOConfig, load_config
from verl.distributed import Placement
from verl.errors import VerlConfigError
from verl.trainer.ppo_trainer import PPOTrainer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "agent_arithmetic.yaml"
CI_SIZED = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
            "model.tiny.intermediate_size=64", "data.num_examples=64", "data.train_batch_size=4", "rollout.n=4",
            "actor.mini_batch_size=4", "actor.micro_batch_size=8", "warmup.steps=30", "warmup.batch_size=8",
            "agent.env_settings.demo_tool_rate=0.5", "trainer.total_steps=2", "trainer.progress_bar=false",
            "trainer.tensorboard=false", "trainer.export_hf=false", "trainer.save_final=false", "trainer.device=cpu"]
AGENT_METRICS = ("rollout/turns_mean", "rollout/tool_calls_mean", "rollout/tool_use_rate",
                 "rollout/observation_tokens_frac", "rollout/tito_mismatch", "rollout/truncated_frac",
                 "perf/tito_check_ms_per_turn")


def test_agent_arithmetic_trains_exactly_the_sampled_tokens(tmp_path, monkeypatch):
    seen: dict[int, list[int]] = {}
    finish = _Episodes.finish

    def record(self, request, output):
        seen.setdefault(request.key, []).extend(output.token_ids)
        return finish(self, request, output)
    monkeypatch.setattr(_Episodes, "finish", record)
    cfg = load_config(PPOConfig, EXAMPLE, [*CI_SIZED, f"trainer.output_dir={tmp_path}"])
    trainer = PPOTrainer(cfg, Placement())
    trainer.setup()
    for step in range(2):
        seen.clear()
        out = trainer._run_flow(None)
        batch = out["batch"]
        assert len(batch) == len(seen) == 16
        P = batch.prompt_length
        for b in range(len(batch)):  # row b is trajectory b (prompt-major, one rank)
            trained = batch.input_ids[b, P:][batch.response_mask[b] > 0].tolist()
            assert trained == seen[b]
            context = batch.attention_mask[b, P:].sum() - batch.response_mask[b].sum()
            assert context >= 0  # observations stay in attention, out of the loss
        metrics = trainer._metrics(out, 1.0)
        trainer.step += 1
        for key in AGENT_METRICS:
            assert key in metrics and metrics[key] == metrics[key], key
        assert "actor/pg_loss" in metrics
    trainer.close()


def test_agent_job_via_the_command_line_logs_the_agent_metrics_and_curves(tmp_path):
    from verl.trainer.main_ppo import main
    assert main([str(EXAMPLE), *CI_SIZED, "trainer.plot=true", "trainer.trace_step=2",
                 f"trainer.output_dir={tmp_path}"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(k in r for r in steps for k in AGENT_METRICS)
    assert (tmp_path / "curves.png").is_file()
    # the traced step's timeline holds the dataflow's nodes and every trajectory's turns and environment steps
    events = json.loads((tmp_path / "trace_step_2.json").read_text())["traceEvents"]
    names = {e["name"] for e in events if e.get("cat") == "agent"}
    assert "generate" in names and names - {"generate"}
    assert any(e.get("cat") == "node" and e["name"] == "generate" for e in events)
    assert not list(tmp_path.glob("trace_step_2_agent_*.json"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_agent_job_under_torchrun_async_with_the_rollout_on_its_own_rank(tmp_path):
    """Split placement, trainer.mode=async: rank 1 runs the episodes (its tools on its own thread) and streams the
    batches to rank 0, which trains; every sample carries the weight version that generated it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc_per_node=2", "-m", "verl.trainer.main_ppo", str(EXAMPLE), *CI_SIZED,
           "trainer.total_steps=3", "trainer.placement=split", "actor.ranks=[0]", "rollout.ranks=[1]",
           "reward.ranks=[0]", "trainer.mode=async", "algorithm.max_staleness=1", "trainer.threads=1",
           f"trainer.output_dir={tmp_path}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert all(k in r for k in AGENT_METRICS) and 0 <= r["rollout/staleness_max"] <= 1


@pytest.mark.parametrize("overrides, match", [
    (["agent.max_turns=0"], r"agent.max_turns.*must be >= 1"),
    (["agent.env=arithmetic_tool"], r"unknown environment agent.env='arithmetic_tool' \(did you mean "
                                    r"'arithmetic_tools'\?\)"),
    (["agent.tools=[calculater]"], r"unknown tool agent.tools='calculater' \(did you mean 'calculator'\?\)"),
    (["agent.format=hermez"], r"unknown tool-call format agent.format='hermez' \(did you mean 'hermes'\?\)"),
    (["rollout.decoder=train"], r"agent.env with rollout.decoder=train"),
    (["agent.env=null"], r"agent.tools.*needs agent.env"),
    (["agent.tool_timeout_s=0"], r"agent.tool_timeout_s.*must be > 0"),
])
def test_agent_config_errors_name_the_key(overrides, match):
    with pytest.raises(VerlConfigError, match=match):
        load_config(PPOConfig, EXAMPLE, overrides)


def test_unknown_tool_settings_and_env_settings_fail_before_any_step(tmp_path):
    from verl.agents.loop import AgentLoop
    from verl.models.tiny import tiny_tokenizer
    tok = tiny_tokenizer(chat="chatml")
    cfg = load_config(PPOConfig, EXAMPLE, ["agent.tool_settings.sleep.latency_s=1"]).agent
    with pytest.raises(VerlConfigError, match=r"agent.tool_settings has settings for \['sleep'\]"):
        AgentLoop(cfg, tok, response_length=32)
    cfg = load_config(PPOConfig, EXAMPLE, ["agent.env_settings.demo_tool_rat=0.5"]).agent
    with pytest.raises(TypeError, match="demo_tool_rat"):
        AgentLoop(cfg, tok, response_length=32)


def test_the_environment_reward_is_a_reward_source():
    import dataclasses

    from verl.config.ppo import RewardConfig, RewardSourceConfig
    from verl.workers.batch import RolloutBatch
    from verl.workers.reward import build_reward
    import torch
    ids = torch.ones(2, 4, dtype=torch.long)
    batch = RolloutBatch(input_ids=ids, attention_mask=ids, position_ids=ids, response_mask=torch.ones(2, 2),
                         group=torch.tensor([0, 0]), env_rewards=torch.tensor([0.5, -1.0]), prompts=["a", "b"],
                         answers=["1", "2"], response_texts=["1", "3"])
    rewards = build_reward(RewardConfig(sources=[RewardSourceConfig(type="env", weight=2.0),
                                                 RewardSourceConfig(type="rule", name="arithmetic")]), "cpu")
    scores, metrics = rewards.score_with_metrics(batch)
    assert scores.tolist() == [2.0, -2.0] and metrics["reward/env/mean"] == -0.25
    with pytest.raises(Exception, match="set agent.env"):
        build_reward(RewardConfig(type="env"), "cpu").score(dataclasses.replace(batch, env_rewards=None))
    with pytest.raises(VerlConfigError, match="type env .* agent.env is not set"):
        load_config(PPOConfig, None, ["reward.type=env"])


def test_the_score_lands_on_the_last_trained_token_of_a_multi_turn_response():
    """Observations punch holes into the loss mask: the score goes on the last sampled token, not at the column
    the mask's count points to (which may be an observation, where the reward would be masked away)."""
    import torch

    from verl.trainer.ppo_flow import _token_rewards
    mask = torch.tensor([[1., 1., 0., 0., 0., 1., 1., 0.],    # turn, observation, turn, padding
                         [1., 1., 1., 0., 0., 0., 0., 0.],    # one turn
                         [0., 0., 0., 0., 0., 0., 0., 0.]])   # nothing sampled
    out = _token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert out.tolist() == [[0, 0, 0, 0, 0, 0, 2, 0], [0, 0, 3, 0, 0, 0, 0, 0], [0] * 8]
