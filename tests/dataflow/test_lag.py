"""Inputs from earlier runs (config ``lag``): the carried state, the prologue, cycles broken by a lag, and on
two gloo ranks a generator and a trainer on disjoint rank sets overlapping in the trace."""

from __future__ import annotations

import json
import time

import pytest
import torch

from verl import DataflowNode, VerlConfigError, build_dataflow
from verl.testing import run_distributed


@DataflowNode(input_keys=["step"], output_keys=["batch"])
def make(step):
    return torch.full((4,), float(step))


@DataflowNode(input_keys=["batch", "weights"], output_keys=["weights"])
def learn(batch, weights):
    """Reads the previous run's weights (lag) and an earlier run's batch."""
    return weights + batch.sum()


@DataflowNode(input_keys=["weights"], output_keys=["report"])
def report(weights):
    return float(weights)


def test_lag_reads_an_earlier_run_and_skips_the_prologue():
    flow = build_dataflow([make, learn, report], configs={"learn": dict(lag={"batch": 1, "weights": 1})})
    assert ("make", "learn") not in flow.edges  # a lagged value exists before the run: no ordering edge
    assert flow.carried == {("make", "batch"): 1, ("learn", "weights"): 1}
    state = flow.new_state(initial={"weights": torch.tensor(0.0)})
    first = flow.run({"step": 1}, state=state)
    assert "weights" not in first and "report" not in first  # prologue: no batch from a run before yet
    assert torch.equal(first["batch"], torch.full((4,), 1.0))
    second = flow.run({"step": 2}, state=state)
    assert second["report"] == 4.0  # run 1's batch, not run 2's
    third = flow.run({"step": 3}, state=state)
    assert third["report"] == 4.0 + 8.0
    assert state.runs == 3 and torch.equal(state.lagged("batch"), torch.full((4,), 2.0))


def test_lag_k_delays_by_k_runs_and_state_dict_resumes_exactly():
    flow = build_dataflow([make, learn, report], configs={"learn": dict(lag={"batch": 2, "weights": 1})})
    state = flow.new_state(initial={"weights": torch.tensor(0.0)})
    got = [flow.run({"step": s}, state=state).get("report") for s in range(1, 4)]
    assert got == [None, None, 4.0]
    saved = state.state_dict()
    resumed = flow.new_state()
    resumed.load_state_dict(saved)
    rest_a = [flow.run({"step": s}, state=state)["report"] for s in range(4, 6)]
    rest_b = [flow.run({"step": s}, state=resumed)["report"] for s in range(4, 6)]
    assert rest_a == rest_b == [4.0 + 8.0, 4.0 + 8.0 + 12.0]
    other = build_dataflow([make, learn, report], configs={"learn": dict(lag={"batch": 1})})
    with pytest.raises(VerlConfigError, match="carries"):
        other.new_state().load_state_dict(saved)


def test_cycle_without_lag_is_rejected_naming_it_and_a_lag_breaks_it():
    @DataflowNode(input_keys=["weights"], output_keys=["batch"])
    def rollout(weights):
        return weights * 2

    @DataflowNode(input_keys=["batch"], output_keys=["weights"])
    def train(batch):
        return batch + 1

    with pytest.raises(VerlConfigError, match=r"cycle: rollout -\[key 'batch'\] -> train -\[key 'weights'\] -> "
                                              r"rollout.*configs\['train'\] = dict\(lag=\{'batch': 1\}\)"):
        build_dataflow([rollout, train])
    flow = build_dataflow([rollout, train], configs={"rollout": dict(lag={"weights": 1})})
    assert flow.order == ("rollout", "train")
    state = flow.new_state(initial={"weights": torch.tensor(1.0)})
    outs = [float(flow.run({}, state=state)["weights"]) for _ in range(3)]
    assert outs == [3.0, 7.0, 15.0]


def test_bad_lags_and_a_missing_state_are_config_errors():
    with pytest.raises(VerlConfigError, match="lag names key 'bach'.*did you mean 'batch'"):
        build_dataflow([make, learn], configs={"learn": dict(lag={"bach": 1})})
    with pytest.raises(VerlConfigError, match=r"lag\['batch'\]=0 must be an int >= 1"):
        build_dataflow([make, learn], configs={"learn": dict(lag={"batch": 0})})
    with pytest.raises(VerlConfigError, match="reads 'step' with lag 1, but no node produces 'step'"):
        build_dataflow([make], configs={"make": dict(lag={"step": 1})})
    flow = build_dataflow([make, learn], configs={"learn": dict(lag={"batch": 1})})
    with pytest.raises(VerlConfigError, match="pass state=flow.new_state"):
        flow.run({"step": 1, "weights": 0.0})
    with pytest.raises(VerlConfigError, match="no node reads 'weights' with a lag"):
        flow.new_state(initial={"weights": 1.0})


# ---- two ranks: generation on rank 1 overlaps training on rank 0 -----------------------------------------------
class Versioned:
    """A batch whose samples carry the weight version that generated them (what the trace reports)."""

    def __init__(self, data: torch.Tensor, version: int):
        self.data = data
        self.weight_version = torch.full((len(data),), version)

    def __len__(self) -> int:
        return len(self.data)


@DataflowNode(input_keys=["version", "seconds"], output_keys=["gen_batch"])
def generate_slowly(version, seconds):
    time.sleep(seconds)
    return Versioned(torch.arange(4.0), version)


@DataflowNode(input_keys=["gen_batch", "seconds"], output_keys=["trained_on"])
def train_slowly(gen_batch, seconds):
    time.sleep(seconds)
    return int(gen_batch.weight_version.max())


def _overlap_body(rank, world_size, trace_path):
    flow = build_dataflow([generate_slowly, train_slowly],
                          configs={"generate_slowly": dict(device_map=[1]),
                                   "train_slowly": dict(device_map=[0], lag={"gen_batch": 1},
                                                        replicated_outputs=["trained_on"])})
    state = flow.new_state()
    trained, seconds = [], []
    for version in range(4):
        t0 = time.perf_counter()
        out = flow.run({"version": version, "seconds": 0.4}, state=state,
                       trace=trace_path if version == 2 else None)
        seconds.append(time.perf_counter() - t0)
        trained.append(out.get("trained_on"))
    return trained, seconds


@pytest.mark.multiprocess
def test_lagged_generation_overlaps_training_on_disjoint_ranks(tmp_path):
    path = str(tmp_path / "trace.json")
    results = run_distributed(_overlap_body, world_size=2, args=(path,), timeout=120)
    trained, seconds = results[0]
    assert trained == [None, 0, 1, 2]  # run k trains on run k-1's batch
    # both sides sleep 0.4 s per run: overlapped, a run takes ~0.4 s, not 0.8 s (generous bound for a busy CPU;
    # run 1 also pays for the first transfer's connections)
    assert max(seconds[2:]) < 0.75, seconds
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "node"]
    gen = next(e for e in events if e["name"] == "generate_slowly")
    train = next(e for e in events if e["name"] == "train_slowly")
    assert (gen["pid"], train["pid"]) == (1, 0)
    assert gen["ts"] < train["ts"] + train["dur"] and train["ts"] < gen["ts"] + gen["dur"]  # they overlap
    assert gen["args"]["outputs"]["gen_batch"]["weight_version"] == [2, 2]
    assert train["args"]["inputs"]["gen_batch"]["weight_version"] == [1, 1]
    assert train["args"]["lag"] == {"gen_batch": 1} and train["args"]["run"] == 2


@DataflowNode(input_keys=["gen_batch", "fail_at"], output_keys=["trained_on"])
def train_or_fail(gen_batch, fail_at):
    if int(gen_batch.weight_version.max()) == fail_at:
        raise ValueError("loss is nan")
    return int(gen_batch.weight_version.max())


def _failure_body(rank, world_size):
    from verl import VerlRuntimeError
    flow = build_dataflow([generate_slowly, train_or_fail],
                          configs={"generate_slowly": dict(device_map=[1]),
                                   "train_or_fail": dict(device_map=[0], lag={"gen_batch": 1})})
    state = flow.new_state()
    for version in range(4):
        try:
            flow.run({"version": version, "seconds": 0.0, "fail_at": 1}, state=state)
        except VerlRuntimeError as e:
            return version, e.node, e.rank, str(e), state.runs
    return None


@pytest.mark.multiprocess
def test_a_failing_trainer_stops_the_generating_side_in_the_same_run():
    results = run_distributed(_failure_body, world_size=2, timeout=120)
    for version, node, rank, message, runs in results:
        assert (version, node, rank, runs) == (2, "train_or_fail", 0, 2)  # run 2 trains run 1's batch
        assert "loss is nan" in message
