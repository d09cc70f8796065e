"""trainer.mode (sync / one_step_off / async): the checks that fail before step 1 and the flows each mode builds
(the runs themselves: tests/trainer/test_one_step_off.py)."""

from __future__ import annotations

import pytest
import torch

from verl.config import PPOConfig, load_config
from verl.errors import VerlConfigError
from verl.trainer.ppo_flow import build_ppo_dataflow

from tests.trainer.conftest import TINY

BASE = [*TINY, "trainer.export_hf=false", "trainer.plot=false", "trainer.save_final=false", "warmup.steps=2",
        "trainer.total_steps=3", "actor.optim.lr=1e-2"]


def _cfg(*overrides: str) -> PPOConfig:
    return load_config(PPOConfig, None, [*BASE, *overrides])


@pytest.mark.parametrize("overrides, match", [
    (["algorithm.max_staleness=-1"], r"algorithm.max_staleness.*-1.*must be >= 0"),
    (["trainer.mode=one_step_off", "algorithm.max_staleness=0"],
     r"trainer.mode=one_step_off .* algorithm.max_staleness=0 forbids"),
    (["trainer.mode=async", "trainer.queue_size=15"],
     r"trainer.queue_size=15 responses cannot hold one batch of data.train_batch_size x rollout.n = 4 x 4 = 16"),
    (["rollout.partial=true", "rollout.engine=hf"], r"rollout.partial=true .* rollout.engine=hf cannot"),
    (["rollout.partial=true"], r"rollout.partial=true .* only trainer.mode=async delivers \(trainer.mode=sync"),
    (["trainer.mode=async", "rollout.tp=2", "rollout.engine=vllm"],
     r"trainer.mode=async .* rollout.tp=2 .* set rollout.tp=1"),
    (["trainer.async_versions=pinned"], r"trainer.async_versions=pinned .* \(trainer.mode=sync generates"),
    (["trainer.mode=async", "trainer.async_versions=pinned", "rollout.partial=true", "algorithm.max_staleness=0"],
     r"rollout.partial=true with trainer.async_versions=pinned .* generation lag is 0 \(algorithm.max_staleness=0"),
    (["trainer.mode=async", "rollout.partial=true", "rollout.partial_switch_token=3"],
     r"rollout.partial_switch_token=3 schedules .* \(rollout.partial=true, trainer.async_versions=newest\)"),
    (["trainer.async_versions=latest"], r"trainer.async_versions.*latest"),
])
def test_bad_mode_settings_fail_when_the_config_is_read(overrides, match):
    with pytest.raises(VerlConfigError, match=match):
        _cfg(*overrides)


@pytest.mark.parametrize("mode, what", [("one_step_off", "one_step_off"),
                                        ("async", "async with algorithm.max_staleness=2")])
def test_overlapping_modes_refuse_colocated_engines_naming_the_ranks(mode, what):
    cfg = _cfg(f"trainer.mode={mode}", "algorithm.max_staleness=2")
    with pytest.raises(VerlConfigError, match=rf"trainer.mode={what} generates while the actor trains, but "
                                              rf"rollout.ranks=\[0, 1\] and actor.ranks=\[0, 1\] share ranks \[0, 1\] "
                                              rf"\(trainer.placement=colocated\)"):
        cfg.validate_world(2)


def test_generation_lag_follows_mode_staleness_and_queue():
    assert _cfg().generation_lag == 0
    assert _cfg("trainer.mode=one_step_off", "algorithm.max_staleness=3").generation_lag == 1
    assert _cfg("trainer.mode=async", "algorithm.max_staleness=3").generation_lag == 3
    assert _cfg("trainer.mode=async", "algorithm.max_staleness=3", "trainer.queue_size=32").generation_lag == 2
    assert _cfg("trainer.mode=async", "algorithm.max_staleness=0").generation_lag == 0
    with pytest.raises(VerlConfigError, match="share ranks"):  # the stages still run at once: own ranks needed
        _cfg("trainer.mode=async", "algorithm.max_staleness=0").validate_world(1)


def test_one_step_off_flow_reads_the_batch_one_run_back():
    flow = build_ppo_dataflow(_cfg("trainer.mode=one_step_off", "algorithm.adv_estimator=gae"), world_size=1)
    assert flow.carried == {("generate", "batch"): 1, ("generate", "gen_metrics"): 1}
    readers = [n for n in flow.order if "batch" in flow.entry(n).node.input_keys]
    assert readers and all(flow.lag(n, "batch") == 1 for n in readers)
    assert ("generate", "sync_weights") in flow.edges and ("generate", "reward") not in flow.edges
    sync_flow = build_ppo_dataflow(_cfg("algorithm.adv_estimator=gae"), world_size=1)
    assert sync_flow.carried == {} and sync_flow.order == flow.order


def test_async_flow_queues_the_generated_batch_into_a_training_stage_of_its_own():
    cfg = _cfg("trainer.mode=async", "algorithm.max_staleness=2", "trainer.placement=split", "actor.ranks=[0]",
               "rollout.ranks=[1]", "reward.ranks=[0]")
    flow = build_ppo_dataflow(cfg, world_size=2)
    assert flow.stages[0] == (("generate",), (1,)) and flow.stages[1][1] == (0,)
    assert "publish_weights" in flow.stages[1][0] and "sync_weights" not in flow.names
    queued = {(p, k) for p, k, _, size in flow.queued if size == 2}
    assert queued == {("generate", "batch"), ("generate", "gen_metrics")}
    assert flow.carried == {}


def test_carried_batches_round_trip_through_checkpoint_json():
    import json

    from verl.trainer.carried import decode_state, encode_state
    from verl.workers.batch import RolloutBatch
    ids = torch.arange(12).view(2, 6)
    batch = RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=ids.clone(),
                         response_mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]), group=torch.tensor([0, 0]),
                         rollout_log_probs=torch.randn(2, 3), weight_version=torch.tensor([3, 3]),
                         prompts=[[{"role": "user", "content": "1+1="}]] * 2, answers=["2", "2"],
                         response_texts=["2</s>", "3"])
    state = {"runs": 4, "carried": {"generate/batch": [batch, None]}}
    back = decode_state(json.loads(json.dumps(encode_state(state))))
    got, empty = back["carried"]["generate/batch"]
    assert back["runs"] == 4 and empty is None
    for name in ("input_ids", "attention_mask", "position_ids", "response_mask", "group", "rollout_log_probs",
                 "weight_version"):
        a, b = getattr(batch, name), getattr(got, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (got.prompts, got.answers, got.response_texts) == (batch.prompts, batch.answers, batch.response_texts)


def test_the_one_step_off_example_validates_on_4_ranks():
    from pathlib import Path

    from verl.trainer.ppo_flow import node_configs
    cfg = load_config(PPOConfig, Path(__file__).parents[2] / "examples/one_step_off.yaml")
    cfg.validate_world(4)
    nodes = node_configs(cfg, cfg.roles(4))
    assert nodes["generate"].device_map == (2, 3) and not nodes["generate"].lag
    assert nodes["update_actor"].device_map == (0, 1) and nodes["update_actor"].lag == {"batch": 1}
    assert nodes["sync_weights"].device_map == (0, 1, 2, 3)
    with pytest.raises(VerlConfigError, match="share ranks"):  # the same job with the rollout on the actor's ranks
        load_config(PPOConfig, Path(__file__).parents[2] / "examples/one_step_off.yaml",
                    ["rollout.ranks=[0,1]"]).validate_world(4)


def test_the_async_example_validates_on_4_ranks():
    from pathlib import Path

    cfg = load_config(PPOConfig, Path(__file__).parents[2] / "examples/async.yaml")
    cfg.validate_world(4)
    flow = build_ppo_dataflow(cfg, world_size=4)
    assert flow.stages[0] == (("generate",), (2, 3)) and flow.stages[1][1] == (0, 1)
    assert all(size == 2 for *_, size in flow.queued)
