"""The agent loop inside the rollout engines: multi-turn trajectories token-in-token-out (the trained tokens are the
sampled ones, observations masked), the classic single-turn samples reproduced exactly, trajectories never waiting
for each other's environments, and what ends or breaks an episode."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from verl.agents import Environment, StepResult
from verl.agents.loop import AgentLoop, _Episodes
from verl.config.ppo import AgentConfig
from verl.errors import VerlRuntimeError
from verl.rollout import RolloutConfig, SamplingParams, build_rollout
from verl.models.tiny import tiny_model, tiny_tokenizer
from verl.workers.batch import batch_from_outputs

ROWS = [{"prompt": p, "answer": "0"} for p in ("alpha", "beta", "gamma")]


class ScriptedEnv(Environment):
    """`turns` observations ("obs k" in a tool turn), then done; reward = number of turns taken."""

    def __init__(self, turns: int = 2, overflow: bool = False):
        self.turns, self.overflow = turns, overflow

    def reset(self, sample):
        self.prompt = sample["prompt"]
        return [{"role": "user", "content": sample["prompt"]}]

    async def step(self, turn):
        if turn.index >= self.turns:
            return StepResult(done=True, reward=float(turn.index + 1), answer=f"done {self.prompt}")
        content = "x " * 200 if self.overflow else f"obs {turn.index}"
        return StepResult(observations=[{"role": "tool", "content": content}], reward=0.0)


_GATE: dict = {}


class GateEnv(Environment):
    """'wait' blocks in its first step until 'go' has finished three steps: a loop that made one trajectory wait for
    another's environment (lockstep turns) would never get there."""

    def reset(self, sample):
        self.prompt = sample["prompt"]
        return [{"role": "user", "content": sample["prompt"]}]

    async def step(self, turn):
        gate = _GATE.setdefault(id(asyncio.get_running_loop()), asyncio.Event())
        if self.prompt == "wait" and turn.index == 0:
            await gate.wait()
        if self.prompt == "go" and turn.index == 2:
            gate.set()
        done = turn.index >= (2 if self.prompt == "go" else 1)
        return StepResult(done=done, observations=[] if done else [{"role": "tool", "content": "ok"}])


class BrokenEnv(ScriptedEnv):
    async def step(self, turn):
        raise KeyError("no such state")


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer(["alpha beta gamma obs tool\n user assistant 0 1 2 3 x"] * 20, 90, chat="chatml")


def engine(tok, decoder="fast", **kw):
    """The torch engine with `decoder`, or (decoder="hf") transformers' generate, which serves turns in waves."""
    model = tiny_model(vocab_size=len(tok), max_position_embeddings=256, seed=3, noise=0.1)
    cfg = RolloutConfig(engine="hf", **kw) if decoder == "hf" else RolloutConfig(engine="torch", decoder=decoder, **kw)
    return build_rollout(cfg, model=model, tokenizer=tok)


def agent(tok, env, response=64, **kw):
    cfg = AgentConfig(env=f"tests.agents.test_loop:{env}", max_tokens_per_turn=6, **kw)
    return AgentLoop(cfg, tok, response_length=response)


PARAMS = SamplingParams(max_new_tokens=64, n=2, temperature=1.0, seed=11, logprobs=True)


def recorded(monkeypatch) -> dict:
    """Every turn the engine hands back, by trajectory: what was sampled."""
    seen: dict[int, list[list[int]]] = {}
    original = _Episodes.finish

    def finish(self, request, output):
        seen.setdefault(request.key, []).append(list(output.token_ids))
        return original(self, request, output)
    monkeypatch.setattr(_Episodes, "finish", finish)
    return seen


@pytest.mark.parametrize("decoder", ["fast", "model", "hf"])
def test_trajectories_are_the_sampled_ids_plus_masked_observations(tok, monkeypatch, decoder):
    seen = recorded(monkeypatch)
    loop = agent(tok, "ScriptedEnv", max_turns=4, env_settings={"turns": 2})
    outs, metrics = loop.rollout(engine(tok, decoder), ROWS, PARAMS)
    loop.close()
    assert len(outs) == 6 and [(o.prompt_index, o.sample_index) for o in outs] == [(i, j) for i in range(3)
                                                                                   for j in range(2)]
    for key, o in enumerate(outs):
        turns = seen[key]
        trained = [t for t, m in zip(o.token_ids, o.loss_mask) if m]
        assert trained == [t for turn in turns for t in turn]  # every trained token was sampled, in order
        assert len(turns) == 3 and o.reward == 3.0 and o.text == f"done {ROWS[o.prompt_index]['prompt']}"
        obs = [t for t, m in zip(o.token_ids, o.loss_mask) if not m]
        assert "obs 0" in tok.decode(obs) and "obs 1" in tok.decode(obs)
        assert all(lp == 0.0 for lp, m in zip(o.logprobs, o.loss_mask) if not m)
    assert metrics["rollout/turns_mean"] == 3.0 and metrics["rollout/tito_mismatch"] >= 0
    assert 0 < metrics["rollout/observation_tokens_frac"] < 1 and metrics["rollout/truncated_frac"] == 0
    batch = batch_from_outputs(outs, ROWS, 2, 64, tok.pad_token_id)
    P = batch.prompt_length
    for b, o in enumerate(outs):
        assert batch.response_mask[b, :len(o.token_ids)].tolist() == [float(m) for m in o.loss_mask]
        assert batch.attention_mask[b, P:P + len(o.token_ids)].tolist() == [1] * len(o.token_ids)
    assert batch.env_rewards.tolist() == [3.0] * 6


def test_single_turn_episodes_are_the_classic_samples(tok):
    """The single_turn environment through the loop samples exactly what `generate` samples (same seeds)."""
    eng = engine(tok)
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": "0"} for r in ROWS]
    loop = AgentLoop(AgentConfig(env="single_turn", max_turns=1), tok, response_length=8)
    params = dataclasses.replace(PARAMS, max_new_tokens=8)
    outs, _ = loop.rollout(eng, rows, params)
    loop.close()
    classic = eng.generate([r["prompt"] for r in rows],
                           dataclasses.replace(params, stop_token_ids=tuple(loop.chat.stop_ids)))
    assert [o.token_ids for o in outs] == [c.token_ids for c in classic]
    assert [o.prompt_token_ids for o in outs] == [c.prompt_token_ids for c in classic]


@pytest.mark.parametrize("decoder", ["fast", "model"])
def test_a_trajectory_waiting_on_its_environment_never_blocks_the_others(tok, decoder):
    loop = agent(tok, "GateEnv", max_turns=4, step_timeout_s=20)
    rows = [{"prompt": "wait", "answer": "0"}, {"prompt": "go", "answer": "0"}]
    outs, metrics = loop.rollout(engine(tok, decoder), rows, dataclasses.replace(PARAMS, n=1))
    loop.close()
    assert [sum(1 for _ in o.loss_mask) > 0 for o in outs] == [True, True]
    assert metrics["rollout/turns_mean"] == 2.5  # wait: 2 turns, go: 3


def test_what_ends_an_episode(tok):
    # max_turns cuts an episode that wanted more (truncated), an observation that does not fit ends it (truncated)
    loop = agent(tok, "ScriptedEnv", max_turns=2, env_settings={"turns": 5})
    outs, m = loop.rollout(engine(tok), ROWS[:1], PARAMS)
    assert all(o.finish_reason == "length" for o in outs) and m["rollout/truncated_frac"] == 1.0
    assert m["rollout/turns_mean"] == 2.0
    loop.close()
    loop = agent(tok, "ScriptedEnv", response=48, env_settings={"turns": 3, "overflow": True})
    outs, m = loop.rollout(engine(tok), ROWS[:1], PARAMS)
    assert m["rollout/truncated_frac"] == 1.0 and all(sum(o.loss_mask) == len(o.token_ids) for o in outs)
    loop.close()


def test_environment_failures_name_the_environment(tok):
    loop = agent(tok, "BrokenEnv")
    with pytest.raises(VerlRuntimeError, match="BrokenEnv.*KeyError"):
        loop.rollout(engine(tok), ROWS[:1], PARAMS)
    loop.close()


def test_multi_turn_batches_train_padding_free_like_padded(tok):
    """The observation tokens are context: the packed (padding-free) and padded log-prob passes agree on a
    multi-turn batch, and both give 0 where the loss mask is 0."""
    from verl.config.ppo import ActorConfig
    from verl.distributed import Placement
    from verl.workers import ActorWorker, TorchEngine
    loop = agent(tok, "ScriptedEnv", max_turns=3, env_settings={"turns": 2})
    eng = engine(tok)
    outs, _ = loop.rollout(eng, ROWS, PARAMS)
    loop.close()
    batch = batch_from_outputs(outs, ROWS, 2, 64, tok.pad_token_id)
    def worker(free):
        return ActorWorker(TorchEngine(eng.model, None, Placement()), ActorConfig(padding_free=free),
                           temperature=1.0, responses_per_mini=6, max_response_length=64)
    packed, _ = worker(True).compute_log_probs(batch)
    padded, _ = worker(False).compute_log_probs(batch)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    assert bool((padded[batch.response_mask == 0] == 0).all())
    # the rollout's log-probs of the sampled tokens are the policy's own
    torch.testing.assert_close(padded * batch.response_mask, batch.rollout_log_probs * batch.response_mask,
                               atol=1e-4, rtol=1e-4)


def test_partial_rollouts_record_each_sampled_tokens_version(tok):
    """With a pause hook (rollout.partial) the torch engine serves in waves that call it between tokens: every
    sampled token carries the version it was sampled with, observations -1, and the batch's per-sample version is
    the oldest of its tokens'."""
    eng = engine(tok)
    versions = iter(range(10_000))
    eng.pause_hook = lambda: next(versions) // 7  # the version moves every few tokens
    loop = agent(tok, "ScriptedEnv", max_turns=3, env_settings={"turns": 2})
    outs, _ = loop.rollout(eng, ROWS[:2], PARAMS)
    loop.close()
    for o in outs:
        assert len(o.token_versions) == len(o.token_ids)
        assert all((v >= 0) == bool(m) for v, m in zip(o.token_versions, o.loss_mask))
    batch = batch_from_outputs(outs, ROWS[:2], 2, 64, tok.pad_token_id)
    sampled = batch.token_version[batch.response_mask > 0]
    assert bool((sampled >= 0).all()) and batch.weight_version.tolist() == \
        [min(v for v in o.token_versions if v >= 0) for o in outs]
