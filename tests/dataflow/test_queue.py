"""Queued inputs (NodeConfig.queue): stages on disjoint ranks that run at their own pace, FIFO, bounded."""

from __future__ import annotations

import time

import pytest
import torch

from verl import DataflowNode, VerlConfigError, build_dataflow
from verl.testing import run_distributed


@DataflowNode(input_keys=["index", "seconds"], output_keys=["made"])
def produce(index, seconds):
    time.sleep(seconds)
    return torch.full((4, 2), float(index))


@DataflowNode(input_keys=["made", "seconds"], output_keys=["seen"])
def consume(made, seconds):
    time.sleep(seconds)
    return [float(made[0, 0]), len(made)]


@DataflowNode(input_keys=["weights"], output_keys=["made"])
def rollout(weights):
    return weights


@DataflowNode(input_keys=["made"], output_keys=["weights"])
def learn(made):
    return made


def test_queues_split_the_dataflow_into_stages_on_disjoint_ranks():
    flow = build_dataflow([produce, consume], configs={"produce": dict(device_map=[1]),
                                                       "consume": dict(device_map=[0], queue={"made": 2})},
                          world_size=2)
    assert flow.stages == ((("produce",), (1,)), (("consume",), (0,)))
    assert flow.queued == [("produce", "made", "consume", 2)]
    # a queue one way with an ordinary input back is one stage: it would wait for itself
    with pytest.raises(VerlConfigError, match="do not split the dataflow"):
        build_dataflow([rollout, learn], configs={"rollout": dict(device_map=[1]),
                                                  "learn": dict(device_map=[0], queue={"made": 2})}, world_size=2)
    with pytest.raises(VerlConfigError, match=r"ranks \[1\] run nodes of two stages"):
        build_dataflow([produce, consume], configs={"produce": dict(device_map=[1]),
                                                    "consume": dict(device_map=[0, 1], queue={"made": 1})},
                       world_size=2)
    with pytest.raises(VerlConfigError, match="'consume' has no device_map"):
        build_dataflow([produce, consume], configs={"produce": dict(device_map=[1]),
                                                    "consume": dict(queue={"made": 1})}, world_size=2)
    with pytest.raises(VerlConfigError, match=r"queue\['made'\]=0 must be an int >= 1"):
        build_dataflow([produce, consume], configs={"consume": dict(queue={"made": 0})}, world_size=2)
    with pytest.raises(VerlConfigError, match="both lag and queue"):
        build_dataflow([produce, consume], configs={"consume": dict(queue={"made": 1}, lag={"made": 1})},
                       world_size=2)
    with pytest.raises(VerlConfigError, match="run input"):
        build_dataflow([consume], configs={"consume": dict(device_map=[0], queue={"made": 1})}, world_size=2)


def _pace_body(rank, world_size, produce_s, consume_s, size):
    """Producer on the last rank, consumer on the others; each side runs its own loop of 5 runs."""
    producer = [world_size - 1]
    flow = build_dataflow([produce, consume],
                          configs={"produce": dict(device_map=producer),
                                   "consume": dict(device_map=list(range(world_size - 1)), queue={"made": size},
                                                   replicated_outputs=["seen"])})
    stamps, seen = [], []  # when each run ended (CLOCK_MONOTONIC: comparable between the processes)
    for i in range(5):
        out = flow.run({"index": i, "seconds": produce_s if rank in producer else consume_s})
        stamps.append(time.perf_counter())
        seen.append(out.get("seen"))
    flow.flush(30)
    return stamps, seen


@pytest.mark.multiprocess
def test_the_consumer_takes_values_in_order_and_each_rank_its_shard():
    results = run_distributed(_pace_body, world_size=3, args=(0.0, 0.0, 2), timeout=120)
    for rank in (0, 1):
        _, seen = results[rank]
        assert seen == [[float(i), 2] for i in range(5)]  # FIFO; 4 rows re-split evenly over 2 consumer ranks
    assert results[2][1] == [None] * 5  # the producer's ranks run only their own stage


@pytest.mark.multiprocess
def test_a_fast_producer_runs_ahead_by_the_queue_size_and_no_further():
    # the consumer takes a value at the start of each 0.3 s run; the producer makes them at once. With size 1
    # one value waits and one is in the sender's hands: value i + 2 waits until the consumer takes value i
    results = run_distributed(_pace_body, world_size=2, args=(0.0, 0.3, 1), timeout=120)
    produced, consumed = results[1][0], results[0][0]
    assert results[0][1] == [[float(i), 4] for i in range(5)]
    assert produced[1] < consumed[0] - 0.1  # ran ahead without waiting for the consumer's runs
    # ... but no further: value 3 was put only once run 1 had started taking value 1 (0.3 s before it ended)
    assert produced[3] > consumed[1] - 0.35
    assert produced[4] > consumed[2] - 0.35


@DataflowNode(input_keys=["index"], output_keys=["made"])
def produce_or_fail(index):
    if index == 2:
        raise ValueError("the engine crashed")
    return torch.full((2, 2), float(index))


def _failure_body(rank, world_size):
    from verl import VerlRuntimeError
    flow = build_dataflow([produce_or_fail, consume],
                          configs={"produce_or_fail": dict(device_map=[1]),
                                   "consume": dict(device_map=[0], queue={"made": 2})})
    for i in range(5):
        try:
            flow.run({"index": i, "seconds": 0.0})
        except VerlRuntimeError as e:
            return i, e.node, e.rank, str(e)
    return None


@pytest.mark.multiprocess
def test_a_failing_producer_fails_the_consumers_run_that_takes_its_value():
    results = run_distributed(_failure_body, world_size=2, timeout=120)
    for i, node, rank, message in results:  # both sides fail in their run 2, naming the producer's node and rank
        assert (i, node, rank) == (2, "produce_or_fail", 1), message
        assert "the engine crashed" in message
