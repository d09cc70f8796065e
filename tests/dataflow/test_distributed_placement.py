"""Placement on 4 gloo ranks: split generate/score, redistribution, errors reaching every rank, merged traces."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from verl import DataflowNode, VerlRuntimeError, build_dataflow
from tests.dataflow.rows import Rows
from verl.testing import run_distributed

pytestmark = pytest.mark.multiprocess


class TinyActor:
    """Stand-in for a generation engine: the 'response' is a deterministic function of the prompt."""

    def generate(self, prompts: Rows, max_new_tokens: int = 4) -> Rows:
        resp = prompts.ids * 2 + torch.arange(max_new_tokens)[: prompts.ids.shape[1]]
        return Rows(ids=resp, text=[f"{p} => {int(r.sum())}" for p, r in zip(prompts.text, resp)])


class TinyRewardModel:
    def score(self, response: Rows) -> torch.Tensor:
        return response.ids.float().sum(-1) + torch.tensor([len(t) for t in response.text]).float()


def _prompts(rank: int, n: int = 3) -> Rows:
    return Rows(ids=torch.arange(n * 2).view(n, 2) + 100 * rank, text=[f"r{rank}-{i}" for i in range(n)])


@DataflowNode(input_keys=["prompt", "actor_model"], output_keys=["response"])
def generate(prompt, actor_model, ctx=None):
    assert ctx.rank in ctx.ranks
    return actor_model.generate(prompt, max_new_tokens=2)


@DataflowNode(input_keys=["response", "reward_model"], output_keys=["reward", "score_ranks"])
def score(response, reward_model, fail_on_rank=-1, ctx=None):
    if ctx.rank == fail_on_rank:
        raise ValueError(f"reward model exploded on purpose (rank {ctx.rank})")
    return reward_model.score(response), {"ranks": list(ctx.ranks), "engine": ctx.engine}


@DataflowNode(input_keys=["reward"], output_keys=["mean_reward"])
def ppo_step(reward, ctx=None):
    # A data-parallel reduction over the node's own group, as an optimizer step would do.
    total = torch.stack([reward.sum(), torch.tensor(float(reward.shape[0]))])
    dist.all_reduce(total, group=ctx.process_group)
    return total[0] / total[1]


def _split_flow(fail_on_rank: int = -1):
    return build_dataflow(
        nodes=[generate, score, ppo_step],
        configs={"generate": dict(engine="vllm", device_map=["cpu:0", "cpu:1"]),
                 "score": dict(engine="rule", device_map=[2, 3], fail_on_rank=fail_on_rank,
                               replicated_outputs=["score_ranks"])})


def _inputs(rank):
    return {"prompt": _prompts(rank), "actor_model": TinyActor(), "reward_model": TinyRewardModel()}


def _split_run(rank, trace_path, check_errors="node"):
    inputs = _inputs(rank)
    if rank >= 2:  # the scorer's ranks need only the scorer's inputs
        del inputs["prompt"], inputs["actor_model"]
    out = _split_flow().run(inputs, trace=trace_path, check_errors=check_errors)
    return {k: (v.text if isinstance(v, Rows) else v) for k, v in out.items()
            if k in ("response", "reward", "mean_reward", "score_ranks")}


def _error_run(rank, colocated):
    if colocated:
        flow = build_dataflow(nodes=[generate, score, ppo_step], configs={"score": dict(fail_on_rank=1)})
    else:
        flow = _split_flow(fail_on_rank=3)
    try:
        flow.run(_inputs(rank))
    except VerlRuntimeError as e:
        return {"node": e.node, "rank": e.rank, "msg": str(e),
                "cause": type(e.__cause__).__name__ if e.__cause__ is not None else None}
    return None


def _missing_input_run(rank):
    inputs = _inputs(rank)
    if rank == 1:
        del inputs["prompt"]
    try:
        _split_flow().run(inputs)
    except Exception as e:  # noqa: BLE001 - the type is what the test checks
        return {"type": type(e).__name__, "msg": str(e)}
    return None


def _body(rank, world_size, trace_path):
    # One spawn for every scenario (starting 4 interpreters dominates the cost); running them one after
    # another also shows that the ranks are still in step after a failed run.
    return {"split": _split_run(rank, trace_path), "error_split": _error_run(rank, colocated=False),
            "error_colocated": _error_run(rank, colocated=True), "after": _split_run(rank, None, check_errors="end"),
            "missing": _missing_input_run(rank)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    trace = str(tmp_path_factory.mktemp("trace") / "split.json")
    return run_distributed(_body, world_size=4, args=(trace,), timeout=150), trace


def test_split_placement_redistributes_shards(results):
    per_rank, trace = results
    res = [r["split"] for r in per_rank]
    # What a single process would compute for the whole logical batch (ranks 0 and 1 hold the prompts).
    actor, rm = TinyActor(), TinyRewardModel()
    resp = [actor.generate(_prompts(r), max_new_tokens=2) for r in (0, 1)]
    rewards = [rm.score(x) for x in resp]
    assert res[0]["response"] == resp[0].text and res[1]["response"] == resp[1].text
    # each rank returns the outputs it produced or received: rank 0 got the first piece of the reward re-split
    # over the 4 ranks of ppo_step
    torch.testing.assert_close(res[0]["reward"], torch.cat(rewards)[:len(res[0]["reward"])])
    assert "response" not in res[2] or res[2]["response"] == resp[0].text
    torch.testing.assert_close(res[2]["reward"], rewards[0])  # rank 0's shard scored on rank 2
    torch.testing.assert_close(res[3]["reward"], rewards[1])
    expected_mean = torch.cat(rewards).mean()
    for r in range(4):  # ppo_step ran on all 4 ranks on the re-split reward
        torch.testing.assert_close(res[r]["mean_reward"], expected_mean)
    assert res[2]["score_ranks"] == {"ranks": [2, 3], "engine": "rule"}
    for r in range(4):  # the same flow again after two failed runs
        torch.testing.assert_close(per_rank[r]["after"]["mean_reward"], expected_mean)


def test_split_trace_merges_ranks(results):
    _, trace = results
    data = json.load(open(trace))
    nodes = [e for e in data["traceEvents"] if e.get("cat") == "node"]
    by_node: dict[str, list[int]] = {}
    for e in nodes:
        by_node.setdefault(e["name"], []).append(e["pid"])
    assert {k: sorted(v) for k, v in by_node.items()} == {"generate": [0, 1], "score": [2, 3],
                                                          "ppo_step": [0, 1, 2, 3]}
    gen0 = next(e for e in nodes if e["name"] == "generate" and e["pid"] == 0)
    assert gen0["args"]["engine"] == "vllm" and gen0["ph"] == "X" and gen0["dur"] > 0
    assert gen0["args"]["outputs"]["response"]["fields"]["ids"]["shape"] == [3, 2]
    comm = [e for e in data["traceEvents"] if e.get("cat") == "comm"]
    assert {e["args"]["key"] for e in comm} == {"response", "reward"}


@pytest.mark.parametrize("scenario,bad", [("error_split", 3), ("error_colocated", 1)])
def test_error_on_one_rank_reaches_every_rank(results, scenario, bad):
    per_rank, _ = results
    res = [r[scenario] for r in per_rank]
    for r, got in enumerate(res):
        assert got is not None, f"rank {r} finished without an error"
        assert got["node"] == "score" and got["rank"] == bad, got
        assert "reward model exploded on purpose" in got["msg"]
        assert f"rank {bad}" in got["msg"]
    assert res[bad]["cause"] == "ValueError"  # the original exception is chained where it happened


def test_missing_input_on_one_rank_stops_all_ranks(results):
    per_rank, _ = results
    res = [r["missing"] for r in per_rank]
    assert res[1]["type"] == "VerlConfigError" and "node 'generate' needs key 'prompt'" in res[1]["msg"]
    for r in (0, 2, 3):
        assert res[r]["type"] == "VerlRuntimeError" and "rank 1" in res[r]["msg"], res[r]
