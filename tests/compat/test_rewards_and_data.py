"""Upstream verl's dataset layout read as is, and its reward-function interface (custom_reward_function.path /
.name, compute_score(data_source, solution_str, ground_truth, extra_info=None), batched or not, float or dict),
with the bad inputs the issue names."""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.compat.verl_data import dapo_rows, gsm8k_rows, math_rows, write
from verl.config.ppo import PPOConfig, RewardConfig
from verl.config.base import load_config
from verl.data import load_prompt_dataset, load_splits
from verl.errors import VerlConfigError, VerlRuntimeError
from verl.rewards import check_sources, convention, get_reward, score_samples
from verl.workers import build_reward
from verl.workers.batch import RolloutBatch
from tests.trainer.conftest import tiny_args  # noqa: F401  (the tiny trainer job's overrides)


def test_gsm8k_preprocess_layout_is_read_as_is(tmp_path):
    path = write(gsm8k_rows("train", 5, 0), tmp_path / "train.parquet")
    ds = load_prompt_dataset([str(path)])
    row = ds[2]
    want = gsm8k_rows("train", 5, 0)[2]
    assert row["prompt"] == want["prompt"] and row["answer"] == want["reward_model"]["ground_truth"]
    assert row["data_source"] == "openai/gsm8k" and row["extra_info"]["index"] == 2
    # answer_key as a dotted path into the struct column, explicitly
    assert load_prompt_dataset([str(path)], answer_key="reward_model.ground_truth")[2]["answer"] == row["answer"]


def test_a_row_without_ground_truth_names_row_and_file(tmp_path):
    rows = gsm8k_rows("train", 4, 0)
    rows[3]["reward_model"] = {"style": "rule", "ground_truth": None}
    path = write(rows, tmp_path / "bad.parquet")
    with pytest.raises(VerlConfigError, match=r"dataset '.*bad.parquet' row 3: ground truth "
                                              r"'reward_model.ground_truth' is missing"):
        load_prompt_dataset([str(path)])


def test_multi_modal_rows_are_refused(tmp_path):
    rows = [{**r, "images": [b"\x89PNG"]} for r in gsm8k_rows("train", 2, 0)]
    with pytest.raises(VerlConfigError, match=r"row 0 has images .*text-only"):
        load_prompt_dataset([str(write(rows, tmp_path / "mm.parquet"))])


def test_splits_files_and_synthetic_held_out(tmp_path):
    cfg = load_config(PPOConfig, None, [f"data.train_files=[{write(math_rows('train', 6, 0), tmp_path / 'a.parquet')}]",
                                        f"data.val_files=[{write(math_rows('test', 3, 1), tmp_path / 'b.parquet')}]",
                                        "data.val_max_samples=2"])
    train, val = load_splits(cfg.data, cfg.val, seed=1)
    assert (len(train), len(val)) == (6, 2)
    cfg = load_config(PPOConfig, None, ["val.num_examples=16", "data.max_operand=10"])
    train, val = load_splits(cfg.data, cfg.val, seed=1)
    held = {repr(p) for p in val.prompts}
    assert len(held) == 16 and not held & {repr(p) for p in train.prompts}  # never trained on
    assert set(val.sources) == {"arithmetic"}
    cfg = load_config(PPOConfig, None, ["val.num_examples=500", "data.max_operand=3"])
    with pytest.raises(VerlConfigError, match="drew only .* distinct prompts"):
        load_splits(cfg.data, cfg.val, seed=1)


def batch_of(responses, answers, sources, extras=None) -> RolloutBatch:
    n = len(responses)
    ids = torch.ones(n, 3, dtype=torch.long)
    return RolloutBatch(input_ids=ids, attention_mask=ids, position_ids=ids, response_mask=torch.ones(n, 2),
                        group=torch.arange(n), prompts=["q"] * n, answers=list(answers),
                        response_texts=list(responses), data_sources=list(sources),
                        extra_infos=list(extras or [None] * n))


REWARD_FILE = '''
CALLS = []

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    CALLS.append((data_source, extra_info))
    ok = solution_str.strip() == ground_truth
    return {"score": 1.0 if ok else -0.5, "acc": float(ok), "pred": solution_str.strip()}

def batched(data_sources, solution_strs, ground_truths, extra_infos):
    return [float(s == g) for s, g in zip(solution_strs, ground_truths)]

def not_a_number(data_source, solution_str, ground_truth, extra_info=None):
    return "high"
'''


def test_compute_score_file_dict_results_and_metrics(tmp_path, capsys):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    worker = build_reward(RewardConfig(name=f"{path}:compute_score"), torch.device("cpu"))
    batch = batch_of(["4", "5", "4"], ["4", "4", "4"], ["src_a", "src_a", "src_b"], [{"i": 0}, {"i": 1}, {"i": 2}])
    scores, metrics = worker.score_with_metrics(batch)
    assert scores.tolist() == [1.0, -0.5, 1.0]
    assert metrics["reward/acc/mean"] == pytest.approx(2 / 3)  # numeric extras per key; 'pred' (text) is not one
    assert not any("pred" in k for k in metrics)
    fn = get_reward(f"{path}:compute_score")
    assert convention(fn) == "verl" and fn.__globals__["CALLS"][-1] == ("src_b", {"i": 2})
    assert f"loaded from {path}" in capsys.readouterr().out  # where user code came from is logged


def test_batched_compute_score(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    fn = get_reward(f"{path}:batched")
    assert convention(fn) == "verl_batched"
    scores, extra = score_samples(fn, ["1", "2"], ["1", "1"], ["", ""], ["a", "a"])
    assert scores.tolist() == [1.0, 0.0] and extra == {}


def test_bad_reward_functions_are_named(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    with pytest.raises(VerlConfigError, match=r"the reward file '.*nope.py' does not exist"):
        get_reward(f"{tmp_path / 'nope.py'}:compute_score")
    with pytest.raises(VerlConfigError, match=r"has no function 'compute_scor'.*its functions: batched, "
                                              r"compute_score, not_a_number"):
        get_reward(f"{path}:compute_scor")
    with pytest.raises(VerlRuntimeError, match=r"reward 'x' returned 'high' for sample 0 \(response '7'"):
        score_samples(get_reward(f"{path}:not_a_number"), ["7"], ["7"], [""], name="x")
    with pytest.raises(VerlRuntimeError, match=r"returned a dict without 'score'"):
        score_samples(lambda r, g, p: {"acc": 1.0}, ["7"], ["7"], [""])
    with pytest.raises(VerlRuntimeError, match=r"returned nan"):
        score_samples(lambda r, g, p: {"score": math.nan}, ["7"], ["7"], [""])


def test_by_data_source_routes_each_row():
    fn = get_reward("by_data_source")
    assert fn("openai/gsm8k", "so 3 + 4 = 7\n#### 7", "7") == 1.0
    assert fn("openai/gsm8k", "the answer is 7", "7") == 0.0  # upstream's strict format: no '####', no credit
    assert fn("DigitalLearningGmbH/MATH-lighteval", "so \\boxed{\\dfrac{1}{2}}", "\\frac12") == 1.0
    assert fn("lighteval/MATH", "\\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert fn("lighteval/MATH", "\\boxed{3}", "4") == 0.0
    assert fn("math_dapo", "work...\nAnswer: 1,200", "1200") == {"score": 1.0, "acc": 1.0}
    assert fn("aime_2024", "Answer: \\boxed{17}", "18") == {"score": -1.0, "acc": 0.0}
    assert fn("arithmetic", "12", "12") == 1.0
    with pytest.raises(VerlRuntimeError, match=r"no built-in reward for data_source 'my/source'.*"
                                               r"custom_reward_function.path"):
        fn("my/source", "x", "y")


def test_unknown_data_source_is_a_config_error_before_training(tmp_path):
    rows = [{**r, "data_source": "my/source"} for r in dapo_rows("math_dapo", 2, 0)]
    cfg = load_config(PPOConfig, None, ["reward.name=by_data_source",
                                        f"data.train_files=[{write(rows, tmp_path / 'x.parquet')}]"])
    train, _ = load_splits(cfg.data, cfg.val, seed=1)
    with pytest.raises(VerlConfigError, match=r"by_data_source has no rule for data_source \['my/source'\]"):
        check_sources(cfg.reward, [train])


def test_dapo_overlong_penalty():
    cfg = RewardConfig(name="arithmetic", overlong_buffer=4, overlong_penalty_factor=1.0)
    worker = build_reward(cfg, torch.device("cpu"), max_response_length=8)
    batch = batch_of(["3", "3", "3"], ["3", "3", "3"], ["arithmetic"] * 3)
    batch.response_mask = torch.tensor([[1.0] * 4 + [0.0] * 4, [1.0] * 6 + [0.0] * 2, [1.0] * 8])
    scores, metrics = worker.score_with_metrics(batch)
    # lengths 4, 6, 8 against limit 8 - buffer 4: no penalty, -2/4, -4/4
    assert scores.tolist() == [1.0, 0.5, 0.0] and metrics["reward/overlong_penalty/mean"] == pytest.approx(-0.5)
    with pytest.raises(VerlConfigError, match="overlong_buffer=9 must be at most"):
        build_reward(RewardConfig(overlong_buffer=9), torch.device("cpu"), max_response_length=8)


def test_verl_parquet_trains_through_the_trainer(tmp_path, tiny_args):
    """A verl-layout file, its data sources routed to their rewards, a custom compute_score file, validation."""
    from verl.trainer.main_ppo import main
    reward = tmp_path / "r.py"
    reward.write_text(REWARD_FILE)
    train = write(gsm8k_rows("train", 8, 0) + math_rows("train", 8, 1), tmp_path / "train.parquet")
    val = write(gsm8k_rows("test", 4, 2), tmp_path / "test.parquet")
    assert main(tiny_args(f"data.train_files=[{train}]", f"data.val_files=[{val}]", "data.max_prompt_length=96",
                          "model.tiny.max_position_embeddings=160", f"reward.name={reward}:compute_score",
                          "trainer.total_steps=1", "trainer.test_freq=1", "warmup.steps=0")) == 0
    import json
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "reward/acc/mean" in rows[-1] and "val/openai/gsm8k/reward_mean" in rows[-1]
