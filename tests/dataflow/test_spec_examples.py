"""The SPEC §2 examples, run as written there, with small stand-in models exposing generate / score."""

from __future__ import annotations

import json

import pytest
import torch

import verl
from verl import CustomNode, DataflowNode, VerlRuntimeError, build_dataflow, debug, inject_node
from verl.dataflow import Dataflow
from verl.errors import VerlConfigError


class TinyActor(torch.nn.Module):
    """A real (tiny) torch model behind the `generate` interface: greedy next tokens from an embedding."""

    def __init__(self, vocab: int = 16, dim: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int = 64) -> torch.Tensor:
        ids = prompt
        for _ in range(min(max_new_tokens, 4)):
            nxt = self.head(self.emb(ids[:, -1])).argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        return ids[:, prompt.shape[1]:]


class TinyRewardModel:
    """Reward = fraction of even tokens, so it lies in [0, 1] and some samples fall below 0.5."""

    def score(self, response: torch.Tensor) -> torch.Tensor:
        return (response % 2 == 0).float().mean(-1)


@DataflowNode(input_keys=["prompt", "actor_model"], output_keys=["response"])
def generate_response(prompt, actor_model):
    return actor_model.generate(prompt, max_new_tokens=64)   # torch / vLLM / SGLang behind one interface


@DataflowNode(input_keys=["response", "reward_model"], output_keys=["reward"])
def score_response(response, reward_model):
    return reward_model.score(response)


@DataflowNode(input_keys=["reward"], output_keys=["ppo_reward"])
def ppo_step(reward):
    return reward.clone()


@CustomNode()
def safe_reward_filter(response, reward, threshold=0.5):
    is_safe = reward > threshold
    return dict(reward=reward * is_safe, is_safe=is_safe)


class ConstReward:
    def __init__(self, values):
        self.values = torch.tensor(values)

    def score(self, response):
        return self.values[: response.shape[0]]


def inputs(rewards=None):
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [3, 1, 4]])
    rm = ConstReward(rewards) if rewards is not None else TinyRewardModel()
    return {"prompt": prompt, "actor_model": TinyActor(), "reward_model": rm}


def test_dict_form_runs_as_written():
    dataflow = {                       # a plain dict is a complete dataflow
        "generate": generate_response,
        "score": score_response,
        "dependencies": {"score": ["generate"]},
    }
    x = inputs()
    out = verl.run(dataflow, x)
    expected_resp = x["actor_model"].generate(x["prompt"])
    assert torch.equal(out["response"], expected_resp)
    assert torch.equal(out["reward"], TinyRewardModel().score(expected_resp))
    assert out["prompt"] is x["prompt"]  # inputs come back too
    again = Dataflow.from_dict(dataflow).run(x)
    assert torch.equal(again["reward"], out["reward"])
    assert Dataflow.from_dict(dataflow).order == ("generate", "score")


def test_decorated_node_stays_a_plain_function():
    resp = generate_response(torch.tensor([[1, 2]]), TinyActor())
    assert resp.shape == (1, 4)
    assert generate_response.input_keys == ("prompt", "actor_model")
    assert safe_reward_filter.input_keys == ("response", "reward")
    assert safe_reward_filter.output_keys == ("reward", "is_safe")
    assert dict(safe_reward_filter.settings) == {"threshold": 0.5}


def test_inject_safe_reward_filter_changes_what_ppo_step_sees():
    base = build_dataflow(nodes=[generate_response, score_response, ppo_step])
    flow = inject_node(base_dataflow=base, node=safe_reward_filter, after="score_response", before="ppo_step")
    x = inputs(rewards=[0.9, 0.2, 0.6, 0.4])
    plain, filtered = base.run(x), flow.run(x)
    torch.testing.assert_close(plain["ppo_reward"], torch.tensor([0.9, 0.2, 0.6, 0.4]))
    torch.testing.assert_close(filtered["ppo_reward"], torch.tensor([0.9, 0.0, 0.6, 0.0]))
    assert filtered["is_safe"].tolist() == [True, False, True, False]
    assert filtered["reward"].tolist() == filtered["ppo_reward"].tolist()  # the final 'reward' is the filtered one
    assert "safe_reward_filter" not in base and len(base) == 3                 # the base is unchanged
    assert flow.producer("ppo_step", "reward") == "safe_reward_filter"
    assert flow.producer("safe_reward_filter", "reward") == "score_response"
    assert flow.order == ("generate_response", "score_response", "safe_reward_filter", "ppo_step")


def test_inject_into_dict_form_with_setting_override():
    dataflow = {"generate": generate_response, "score": score_response, "ppo_step": ppo_step,
                "dependencies": {"score": ["generate"]}}
    flow = inject_node(base_dataflow=dataflow, node=safe_reward_filter, after="score", before="ppo_step",
                       config={"threshold": 0.7})
    out = flow.run(inputs(rewards=[0.9, 0.2, 0.6, 0.4]))
    torch.testing.assert_close(out["ppo_reward"], torch.tensor([0.9, 0.0, 0.0, 0.0]))


def test_build_dataflow_configs_bind_placement_and_engine():
    configs = {"generate_response": dict(engine="vllm", device_map=["cuda:0", "cuda:1"]),
               "score_response": dict(engine="torch", device_map=["cuda:0", "cuda:1"], cpu_offload=True),
               "ppo_step": dict(engine="megatron", device_map=[0, 1])}
    flow = build_dataflow(nodes=[generate_response, score_response, ppo_step], configs=configs, world_size=2)
    assert flow.config("generate_response").engine == "vllm"
    assert flow.config("generate_response").device_map == (0, 1)
    assert flow.config("score_response").cpu_offload
    with pytest.raises(VerlConfigError, match=r"device_map names rank\(s\) \[1\] but the world has 1 rank"):
        build_dataflow(nodes=[generate_response, score_response, ppo_step], configs=configs)


def test_trace_file_has_one_event_per_node(tmp_path):
    base = build_dataflow(nodes=[generate_response, score_response, ppo_step])
    flow = inject_node(base_dataflow=base, node=safe_reward_filter, after="score_response", before="ppo_step")
    path = tmp_path / "trace.json"
    out = debug.trace_dataflow(dataflow=flow, inputs=inputs(), save_path=str(path))
    assert "ppo_reward" in out
    data = json.loads(path.read_text())
    events = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["name"] for e in events) == sorted(flow.names)
    assert all(e["pid"] == 0 and e["dur"] >= 0 and e["cat"] == "node" for e in events)
    gen = next(e for e in events if e["name"] == "generate_response")
    assert gen["args"]["inputs"]["prompt"] == {"type": "Tensor", "shape": [4, 3], "dtype": "int64", "device": "cpu"}
    assert gen["args"]["inputs"]["actor_model"]["type"] == "TinyActor"
    assert gen["args"]["outputs"]["response"]["shape"] == [4, 4]
    assert gen["args"]["device"] == "cpu" and gen["args"]["engine"] == "torch" and gen["args"]["retries"] == 0
    flt = next(e for e in events if e["name"] == "safe_reward_filter")
    assert flt["args"]["outputs"]["is_safe"]["dtype"] == "bool"
    starts = {e["name"]: e["ts"] for e in events}
    assert starts["generate_response"] <= starts["score_response"] <= starts["safe_reward_filter"] <= starts["ppo_step"]


def test_run_trace_argument_writes_the_same_trace(tmp_path):
    path = tmp_path / "t.json"
    build_dataflow(nodes=[generate_response, score_response]).run(inputs(), trace=str(path))
    assert len([e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]) == 2


def test_node_failure_is_verl_runtime_error_with_cause(tmp_path):
    class Broken:
        def score(self, response):
            raise KeyError("vocab mismatch")

    x = inputs()
    x["reward_model"] = Broken()
    path = tmp_path / "fail.json"
    with pytest.raises(VerlRuntimeError) as info:
        build_dataflow(nodes=[generate_response, score_response, ppo_step]).run(x, trace=str(path))
    err = info.value
    assert err.node == "score_response" and err.rank == 0
    assert isinstance(err.__cause__, KeyError) and "vocab mismatch" in str(err)
    assert "node 'score_response'" in str(err) and "rank 0" in str(err)
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in events] == ["generate_response", "score_response"]  # ppo_step never ran
    assert "KeyError" in events[1]["args"]["error"]
