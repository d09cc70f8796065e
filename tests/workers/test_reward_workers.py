"""Reward workers: reward models (sequence-classification and value-head directories) score prompt + response
with their own tokenizer; a weighted ensemble of rule and model sources; errors name the source and the sample;
`reward.sources` is validated on load."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from verl.config import PPOConfig, describe, from_dict, load_config
from verl.config.ppo import RewardConfig, RewardSourceConfig
from verl.data import task_corpus
from verl.dataflow import build_dataflow
from verl.errors import VerlConfigError, VerlRuntimeError
from verl.rewards import register_reward
from verl.models.tiny import save_tiny, tiny_model, tiny_tokenizer
from verl.trainer.ppo_flow import reward as reward_node
from verl.workers import ModelRewardWorker, RewardWorker, RolloutBatch, RuleRewardWorker, ValueModel, build_reward
from verl.workers.critic import VALUE_HEAD_FILE

SMALL = dict(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)


def _batch(texts, answers, prompts=None):
    n = len(texts)
    z = torch.zeros(n, 2, dtype=torch.long)  # the policy's ids: a reward model must not read them
    return RolloutBatch(input_ids=z, attention_mask=z, position_ids=z, response_mask=torch.ones(n, 1),
                        group=torch.arange(n), prompts=prompts or ["1+1="] * n, answers=answers, response_texts=texts)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer(task_corpus("arithmetic"), 64)


@pytest.fixture(scope="module")
def classifier_dir(tok, tmp_path_factory):
    rm = tiny_model(head="score", tokenizer=tok, seed=3, noise=0.1, **SMALL)
    return rm, save_tiny(rm, tok, tmp_path_factory.mktemp("classifier"))


@pytest.fixture(scope="module")
def value_dir(tok, tmp_path_factory):
    vm = ValueModel.from_causal_lm(tiny_model(tokenizer=tok, seed=4, noise=0.1, **SMALL)).eval()
    with torch.no_grad():  # a fresh head is all zeros, which would score every sample 0
        vm.value_head.weight.normal_(generator=torch.Generator().manual_seed(0))
        vm.value_head.bias.fill_(0.25)
    return vm, vm.save_pretrained(tmp_path_factory.mktemp("value"), tokenizer=tok)


def _value_at_last_token(vm, ids):
    ids = torch.tensor([ids])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        return vm(ids, mask, torch.arange(ids.shape[1])[None])[0, -1].item()


def test_model_reward_scores_with_the_classification_head(tok, classifier_dir):
    rm, path = classifier_dir
    worker = ModelRewardWorker(str(path), torch.device("cpu"), micro_batch_size=2)
    texts = ["2", "3", "12", "1+1"]
    scores = worker.score(_batch(texts, ["2"] * 4))
    with torch.no_grad():  # each alone, unpadded: micro-batching and right padding change nothing
        alone = [rm(**tok(["1+1=" + t], return_tensors="pt")).logits[0, 0].item() for t in texts]
    torch.testing.assert_close(scores, torch.tensor(alone), rtol=1e-5, atol=1e-6)
    assert len(set(scores.tolist())) == 4
    with pytest.raises(VerlConfigError, match=r"reward\.model_path=.*not a directory"):
        ModelRewardWorker(str(path / "missing"), torch.device("cpu"))


def test_value_head_reward_round_trip(tok, value_dir):
    vm, path = value_dir
    assert (path / VALUE_HEAD_FILE).is_file()
    chat = [{"role": "user", "content": "1+1="}]
    batch = _batch(["2", "13", "4"], ["2"] * 3, prompts=["1+1=", "1+12=", chat])
    scores = build_reward(from_dict(RewardConfig, {"type": "model", "model_path": str(path)}),
                          torch.device("cpu")).score(batch)
    chat_text = tok.apply_chat_template(chat + [{"role": "assistant", "content": "4"}], tokenize=False)
    expected = [_value_at_last_token(vm, tok("1+1=2")["input_ids"]),
                _value_at_last_token(vm, tok("1+12=13")["input_ids"]),
                _value_at_last_token(vm, tok(chat_text, add_special_tokens=False)["input_ids"])]
    torch.testing.assert_close(scores, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert len(set(scores.tolist())) == 3


def test_value_head_beside_a_causal_lm_directory(tok, tmp_path):
    """The other way to make a value-head reward model: a policy's Hugging Face directory plus the head file."""
    lm = tiny_model(tokenizer=tok, seed=5, noise=0.1, **SMALL)
    save_tiny(lm, tok, tmp_path / "lm")
    vm = ValueModel.from_causal_lm(lm).eval()
    with torch.no_grad():
        vm.value_head.weight.normal_(generator=torch.Generator().manual_seed(1))
    vm.save_pretrained(tmp_path / "vm")
    (tmp_path / "lm" / VALUE_HEAD_FILE).write_bytes((tmp_path / "vm" / VALUE_HEAD_FILE).read_bytes())
    score = ModelRewardWorker(str(tmp_path / "lm"), torch.device("cpu")).score(_batch(["7"], ["2"]))
    assert score.item() == pytest.approx(_value_at_last_token(vm, tok("1+1=7")["input_ids"]), rel=1e-5)

    (tmp_path / "lm" / VALUE_HEAD_FILE).write_bytes(b"")
    with pytest.raises(VerlConfigError, match="not a readable safetensors file"):
        ValueModel.from_pretrained(tmp_path / "lm")
    from safetensors.torch import save_file
    save_file({"weight": torch.zeros(1, 8), "bias": torch.zeros(1)}, str(tmp_path / "lm" / VALUE_HEAD_FILE))
    with pytest.raises(VerlConfigError, match=r"hidden_size=16"):
        ValueModel.from_pretrained(tmp_path / "lm")


@register_reward("test_length")
def _length_reward(response, ground_truth, prompt):
    return float(len(response))


def test_ensemble_is_the_weighted_sum_of_its_sources(classifier_dir, value_dir):
    _, cls_path = classifier_dir
    _, val_path = value_dir
    texts, answers = ["2", "3", "12", "22"], ["2"] * 4
    cfg = from_dict(RewardConfig, {"sources": [
        {"type": "rule", "name": "arithmetic", "weight": 1.0},
        {"type": "model", "model_path": str(cls_path), "weight": 0.5, "label": "rm_cls"},
        {"type": "model", "model_path": str(val_path), "weight": -2.0, "label": "rm_value", "normalize": True},
        {"type": "rule", "name": "test_length", "weight": 0.25}]})
    worker = build_reward(cfg, torch.device("cpu"))
    scores, metrics = worker.score_with_metrics(_batch(texts, answers))

    rule = torch.tensor([1.0, 0.0, 0.0, 0.0])
    cls = ModelRewardWorker(str(cls_path), torch.device("cpu")).score(_batch(texts, answers))
    val = ModelRewardWorker(str(val_path), torch.device("cpu")).score(_batch(texts, answers))
    length = torch.tensor([1.0, 1.0, 2.0, 2.0])
    val_z = (val - val.mean()) / val.std(unbiased=False)
    torch.testing.assert_close(scores, rule + 0.5 * cls - 2.0 * val_z + 0.25 * length)
    assert metrics["reward/arithmetic/mean"] == pytest.approx(0.25)
    assert metrics["reward/rm_cls/mean"] == pytest.approx(cls.mean().item())
    assert metrics["reward/rm_value/mean"] == pytest.approx(val.mean().item())  # raw, before normalising
    assert metrics["reward/test_length/std"] == pytest.approx(0.5)
    assert worker.last_metrics == {}
    torch.testing.assert_close(worker.score(_batch(texts, answers)), scores)
    assert worker.last_metrics == metrics


def test_one_source_shorthand_is_that_source_alone():
    worker = build_reward(RewardConfig(), torch.device("cpu"))
    batch = _batch(["2", "3"], ["2", "2"])
    assert worker.score(batch).tolist() == [1.0, 0.0]
    assert worker.last_metrics == {"reward/arithmetic/mean": 0.5, "reward/arithmetic/std": 0.5}
    assert RuleRewardWorker("arithmetic").score(batch).tolist() == [1.0, 0.0]


class _Fixed:
    def __init__(self, values, label="fixed"):
        self.values, self.label = values, label

    def score(self, batch):
        if isinstance(self.values, Exception):
            raise self.values
        return torch.tensor(self.values)


@register_reward("test_raises_on_boom")
def _raises_on_boom(response, ground_truth, prompt):
    if response == "boom":
        raise ValueError("cannot parse")
    return 0.0


def test_bad_scores_raise_naming_the_source_and_the_sample(value_dir):
    batch = _batch(["2", "3", "4"], ["2"] * 3)
    one = [RewardSourceConfig(name="x")]
    with pytest.raises(VerlRuntimeError, match=r"node 'reward'.*'fixed' returned nan for sample 2"):
        RewardWorker([_Fixed([0.0, 1.0, math.nan])], one).score(batch)
    with pytest.raises(VerlRuntimeError, match=r"'fixed' returned inf for sample 1"):
        RewardWorker([_Fixed([0.0, math.inf, 1.0])], one).score(batch)
    with pytest.raises(VerlRuntimeError, match=r"'judge' raised KeyError") as info:
        RewardWorker([_Fixed(KeyError("gone"), "judge")], one).score(batch)
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(VerlRuntimeError, match=r"weighted sum .* inf for sample 0"):
        RewardWorker([_Fixed([3e38, 0.0, 0.0])], [RewardSourceConfig(name="x", weight=10.0)]).score(batch)
    with pytest.raises(VerlRuntimeError, match=r"'test_raises_on_boom' raised ValueError.*sample 1"):
        build_reward(RewardConfig(name="test_raises_on_boom"), torch.device("cpu")).score(
            _batch(["2", "boom"], ["2", "2"]))

    _, path = value_dir
    rm = ModelRewardWorker(str(path), torch.device("cpu"), micro_batch_size=2, label="rm")
    with torch.no_grad():
        rm.model.value_head.bias.fill_(math.nan)
    with pytest.raises(VerlRuntimeError, match=r"'rm' returned nan for sample 0"):
        rm.score(batch)
    rm.model.trunk.forward = _raise_oom
    with pytest.raises(VerlRuntimeError, match=r"'rm' raised RuntimeError: out of memory on samples 0\.\.1"):
        rm.score(batch)
    with pytest.raises(VerlRuntimeError, match=r"'rm': the prompt of sample 1 is Tensor"):
        rm.score(_batch(["2", "3"], ["2", "2"], prompts=["1+1=", torch.tensor([5, 6])]))


def _raise_oom(*args, **kwargs):
    raise RuntimeError("out of memory")


def test_offload_onload_keeps_scores(value_dir, classifier_dir):
    cfg = RewardConfig(sources=[RewardSourceConfig(type="model", model_path=str(value_dir[1]), label="v"),
                                RewardSourceConfig(type="model", model_path=str(classifier_dir[1]), label="c"),
                                RewardSourceConfig(name="arithmetic")])
    worker = build_reward(cfg, torch.device("cpu"))
    batch = _batch(["2", "3", "12"], ["2"] * 3)
    before = worker.score(batch)
    worker.offload()
    assert all(p.device.type == "cpu" for s in worker.sources[:2] for p in s.model.parameters())
    worker.onload(torch.device("cpu"))
    torch.testing.assert_close(worker.score(batch), before, rtol=0, atol=0)

    calls = []  # the dataflow's cpu_offload moves the ensemble around the reward node
    worker.onload = lambda device: calls.append(("onload", str(device)))
    worker.offload = lambda: calls.append(("offload",))
    flow = build_dataflow(nodes=[reward_node], configs={"reward": dict(cpu_offload=True, device_map=["cpu:0"])})
    torch.testing.assert_close(flow.run({"batch": batch, "reward_fn": worker})["scores"], before, rtol=0, atol=0)
    assert calls == [("onload", "cpu"), ("offload",)]


@pytest.mark.cuda
def test_reward_model_on_the_gpu_with_cpu_offload(value_dir, classifier_dir):
    cfg = RewardConfig(sources=[RewardSourceConfig(type="model", model_path=str(value_dir[1]), label="v"),
                                RewardSourceConfig(type="model", model_path=str(classifier_dir[1]), label="c")])
    batch = _batch(["2", "3", "12"], ["2"] * 3)
    expected = build_reward(cfg, torch.device("cpu")).score(batch)
    worker = build_reward(cfg, torch.device("cpu"))
    flow = build_dataflow(nodes=[reward_node], configs={"reward": dict(cpu_offload=True, device_map=["cuda:0"])})
    got = flow.run({"batch": batch, "reward_fn": worker})["scores"]
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-5)
    assert all(p.device.type == "cpu" for s in worker.sources for p in s.model.parameters())


def _reward_error(reward: dict) -> str:
    with pytest.raises(VerlConfigError) as info:
        from_dict(PPOConfig, {"reward": reward})
    return str(info.value)


def test_reward_config_validation():
    rule = {"type": "rule", "name": "arithmetic"}
    assert "reward.sources[1].type" in _reward_error({"sources": [rule, {"type": "modle", "model_path": "x"}]})
    msg = _reward_error({"sources": [rule, {"type": "model", "weight": 0.5}]})
    assert "reward.sources[1].model_path is missing" in msg
    assert "reward.model_path is missing" in _reward_error({"type": "model"})
    for bad in (math.nan, math.inf, "nan"):
        msg = _reward_error({"sources": [rule, {**rule, "weight": bad, "label": "b"}]})
        # NaN is refused by the loader for every float, inf by the source's own check: both name the key
        assert "reward.sources[1].weight" in msg and ("finite" in msg or "NaN" in msg)
    msg = _reward_error({"sources": [{**rule, "weight": 0}, {**rule, "weight": 0.0, "label": "b"}]})
    assert "weight 0" in msg and "non-zero" in msg
    assert "reward.sources[1].label" in _reward_error({"sources": [rule, rule]})
    assert "reward.sources[0].name is missing" in _reward_error({"sources": [{"type": "rule"}]})
    assert "reward.sources[0].model_path is only read by type=model" in _reward_error(
        {"sources": [{**rule, "model_path": "x"}]})
    assert "move that source into reward.sources" in _reward_error({"type": "model", "model_path": "x",
                                                                    "sources": [rule]})
    assert "reward.sources[0].wieght" in _reward_error({"sources": [{**rule, "wieght": 1.0}]})
    assert "reward.micro_batch_size" in _reward_error({"micro_batch_size": 0})
    assert "'reward.sources[0]': expected a mapping" in _reward_error({"sources": ["arithmetic"]})
    help_lines = describe(PPOConfig)
    assert any(line.startswith("reward.sources[].weight = 1.0: Factor") for line in help_lines)
    with pytest.raises(VerlConfigError, match=r"reward\.sources\[1\]\.name: unknown reward 'arithmetc'.*"
                                              r"did you mean 'arithmetic'"):
        build_reward(from_dict(RewardConfig, {"sources": [rule, {**rule, "name": "arithmetc", "label": "b"}]}),
                     torch.device("cpu"))
    with pytest.raises(VerlConfigError, match=r"reward\.sources\[0\]\.model_path='/nonexistent' is not a dir"):
        build_reward(from_dict(RewardConfig, {"sources": [{"type": "model", "model_path": "/nonexistent"}]}),
                     torch.device("cpu"))


def test_reward_sources_from_yaml_and_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"reward": {"micro_batch_size": 8, "sources": [
        {"type": "rule", "name": "arithmetic", "weight": 1.0},
        {"type": "model", "model_path": "/models/rm", "weight": 0.5, "normalize": True}]}}))
    cfg = load_config(PPOConfig, path)
    assert [(s.type, s.display_name, s.weight, s.normalize) for s in cfg.reward.sources] == \
        [("rule", "arithmetic", 1.0, False), ("model", "model", 0.5, True)]
    assert cfg.reward.uses_model and not PPOConfig().reward.uses_model
    cfg = load_config(PPOConfig, path, ["reward.sources=[{type: rule, name: arithmetic, weight: 2}]"])
    assert [(s.name, s.weight) for s in cfg.reward.resolved_sources()] == [("arithmetic", 2.0)]
