"""Bad dataflow graphs, node declarations, node configs and run() calls: each is refused when the dataflow is built
(or run() is called) with a VerlConfigError naming the node, key or value and what to change; nothing runs."""

from __future__ import annotations

import math

import pytest
import torch

from verl import CustomNode, DataflowNode, build_dataflow, inject_node
from verl.errors import VerlConfigError, VerlRuntimeError

CALLS: list[str] = []


@DataflowNode(input_keys=["x"], output_keys=["y"])
def double(x):
    CALLS.append("double")
    return 2 * x


@DataflowNode(input_keys=["y"], output_keys=["z"])
def plus_one(y, bias=1.0):
    CALLS.append("plus_one")
    return y + bias


@DataflowNode(input_keys=["z"], output_keys=["y"])
def also_y(z):
    return z


@DataflowNode(input_keys=["p"], output_keys=["q"])
def q_from_p(p):
    return p


@DataflowNode(input_keys=["q"], output_keys=["p"])
def p_from_q(q):
    return q


@CustomNode()
def clip(z, limit=3.0):
    return dict(z=min(z, limit))


def _with_config(cfg):
    return lambda: build_dataflow(nodes=[double, plus_one], configs={"double": cfg}, world_size=2)


# (case id, builder, substrings the message must contain)
CONFIG_CASES = [
    ("timeout_negative", {"timeout_s": -1}, ["double", "timeout_s", "-1"]),
    ("timeout_nan", {"timeout_s": math.nan}, ["double", "timeout_s", "nan"]),
    ("timeout_inf", {"timeout_s": math.inf}, ["double", "timeout_s", "inf"]),
    ("timeout_string", {"timeout_s": "10"}, ["double", "timeout_s", "'10'"]),
    ("timeout_bool", {"timeout_s": True}, ["double", "timeout_s", "True"]),
    ("timeout_none", {"timeout_s": None}, ["double", "timeout_s", "None"]),
    ("retries_negative", {"retries": -1}, ["double", "retries", "-1"]),
    ("retries_float", {"retries": 1.5}, ["double", "retries", "1.5"]),
    ("retries_bool", {"retries": True}, ["double", "retries", "True"]),
    ("retries_string", {"retries": "2"}, ["double", "retries", "'2'"]),
    ("backoff_negative", {"retry_backoff_s": -0.1}, ["double", "retry_backoff_s", "-0.1"]),
    ("backoff_nan", {"retry_backoff_s": math.nan}, ["double", "retry_backoff_s", "nan"]),
    ("backoff_inf", {"retry_backoff_s": math.inf}, ["double", "retry_backoff_s", "inf"]),
    ("backoff_bool", {"retry_backoff_s": True}, ["double", "retry_backoff_s", "True"]),
    ("backoff_string", {"retry_backoff_s": "fast"}, ["double", "retry_backoff_s", "'fast'"]),
    ("offload_string", {"cpu_offload": "false"}, ["double", "cpu_offload", "'false'"]),
    ("offload_int", {"cpu_offload": 1}, ["double", "cpu_offload", "1"]),
    ("offload_none", {"cpu_offload": None}, ["double", "cpu_offload", "None"]),
    ("engine_typo", {"engine": "vlm"}, ["double", "vlm", "vllm"]),
    ("engine_empty", {"engine": ""}, ["double", "engine"]),
    ("engine_int", {"engine": 3}, ["double", "engine", "3"]),
    ("retry_on_not_a_type", {"retry_on": [ValueError, "TimeoutError"]}, ["double", "retry_on", "TimeoutError"]),
    ("retry_on_int", {"retry_on": [5]}, ["double", "retry_on", "5"]),
    ("device_map_empty", {"device_map": []}, ["double", "device_map", "[]"]),
    ("device_map_negative", {"device_map": [-1]}, ["double", "device_map", "-1"]),
    ("device_map_twice", {"device_map": [0, 0]}, ["double", "rank 0 twice"]),
    ("device_map_gpu_prefix", {"device_map": ["gpu:0"]}, ["double", "'gpu:0'", "cuda:0"]),
    ("device_map_bool", {"device_map": [True]}, ["double", "True", "bool"]),
    ("device_map_bad_index", {"device_map": "cuda:x"}, ["double", "'cuda:x'"]),
    ("device_map_float", {"device_map": [1.5]}, ["double", "1.5"]),
    ("device_map_outside_world", {"device_map": [0, 2]}, ["double", "[2]", "world has 2"]),
    ("unknown_key", {"timeout": 5}, ["double", "'timeout'", "timeout_s"]),
    ("unknown_setting", {"settings": {"bias": 2}}, ["double", "'bias'"]),
    ("settings_not_a_dict", {"settings": 5}, ["double", "settings", "int"]),
    ("config_a_string", "fast", ["double", "str"]),
    ("config_a_list", [1, 2], ["double", "list"]),
]


@pytest.mark.parametrize("cfg, parts", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_clear_bad_node_config(cfg, parts):
    with pytest.raises(VerlConfigError) as info:
        _with_config(cfg)()
    for p in parts:
        assert p in str(info.value), (p, str(info.value))


GRAPH_CASES = [
    ("cycle", lambda: build_dataflow(nodes=[q_from_p, p_from_q]), ["cycle", "q_from_p", "p_from_q"]),
    ("two_producers", lambda: build_dataflow(nodes=[double, plus_one, also_y]), ["'y'", "two nodes"]),
    ("missing_key", lambda: build_dataflow(nodes=[plus_one], inputs=["x"]), ["plus_one", "'y'"]),
    ("configs_unknown_node", lambda: build_dataflow(nodes=[double], configs={"doubel": {}}),
     ["'doubel'", "did you mean 'double'"]),
    ("dependencies_not_a_dict", lambda: build_dataflow(nodes=[double, plus_one], dependencies=["double"]),
     ["dependencies must be a dict", "list"]),
    ("dependencies_unknown_node", lambda: build_dataflow(nodes=[double, plus_one],
                                                         dependencies={"plus_one": ["doubl"]}),
     ["'doubl'", "did you mean 'double'"]),
    ("dependencies_unknown_key", lambda: build_dataflow(nodes=[double, plus_one], dependencies={"plus": ["double"]}),
     ["'plus'", "plus_one"]),
    ("dependencies_self", lambda: build_dataflow(nodes=[double, plus_one], dependencies={"double": ["double"]}),
     ["double", "itself"]),
    ("dependencies_not_a_list", lambda: build_dataflow(nodes=[double, plus_one], dependencies={"plus_one": 3}),
     ["dependencies['plus_one']", "3"]),
    ("dependency_cycle", lambda: build_dataflow(nodes=[double, plus_one], dependencies={"double": ["plus_one"]}),
     ["cycle", "double", "plus_one"]),
    ("no_nodes", lambda: build_dataflow(nodes=[]), ["at least one node"]),
    ("single_node_not_in_a_list", lambda: build_dataflow(nodes=double), ["list of nodes", "wrap"]),
    ("duplicate_node", lambda: build_dataflow(nodes=[double, double]), ["two nodes are named 'double'"]),
    ("empty_node_name", lambda: build_dataflow(nodes={"": double}), ["non-empty", "''"]),
    ("plain_function", lambda: build_dataflow(nodes=[lambda x: x]), ["decorate"]),
    ("inject_unknown_after", lambda: inject_node(build_dataflow(nodes=[double, plus_one]), clip, after="doubl",
                                                 before="plus_one"), ["after='doubl'", "double"]),
    ("inject_unknown_before", lambda: inject_node(build_dataflow(nodes=[double, plus_one]), clip, after="double",
                                                  before="plus"), ["before='plus'", "plus_one"]),
    ("inject_same_point", lambda: inject_node(build_dataflow(nodes=[double, plus_one]), clip, after="double",
                                              before="double"), ["both 'double'"]),
    ("inject_backwards", lambda: inject_node(build_dataflow(nodes=[double, plus_one]), clip, after="plus_one",
                                             before="double"), ["'double' does not run after 'plus_one'"]),
    ("inject_name_clash", lambda: inject_node(build_dataflow(nodes=[double, plus_one]), clip, after="double",
                                              before="plus_one", name="double"), ["already has a node named"]),
]


@pytest.mark.parametrize("build, parts", [c[1:] for c in GRAPH_CASES], ids=[c[0] for c in GRAPH_CASES])
def test_clear_bad_graph(build, parts):
    with pytest.raises(VerlConfigError) as info:
        build()
    for p in parts:
        assert p in str(info.value), (p, str(info.value))


DECLARATION_CASES = [
    ("keys_a_string", lambda: DataflowNode(input_keys="x", output_keys=["y"]), ["list of strings", "['x']"]),
    ("empty_key", lambda: DataflowNode(input_keys=[""], output_keys=["y"]), ["non-empty strings"]),
    ("repeated_key", lambda: DataflowNode(input_keys=["x", "x"], output_keys=["y"]), ["repeat", "'x'"]),
    ("ctx_as_key", lambda: DataflowNode(input_keys=["ctx"], output_keys=["y"]), ["'ctx' is reserved"]),
]


@pytest.mark.parametrize("make, parts", [c[1:] for c in DECLARATION_CASES], ids=[c[0] for c in DECLARATION_CASES])
def test_clear_bad_node_declaration(make, parts):
    with pytest.raises(VerlConfigError) as info:
        make()(lambda x: x)
    for p in parts:
        assert p in str(info.value), (p, str(info.value))


RUN_CASES = [
    ("inputs_a_list", [1.0], ["dict of inputs", "list"]),
    ("missing_input", {"w": 1.0}, ["'x'"]),
]


@pytest.mark.parametrize("inputs, parts", [c[1:] for c in RUN_CASES], ids=[c[0] for c in RUN_CASES])
def test_clear_bad_run_inputs(inputs, parts):
    CALLS.clear()
    df = build_dataflow(nodes=[double, plus_one])
    with pytest.raises(VerlConfigError) as info:
        df.run(inputs)
    for p in parts:
        assert p in str(info.value), (p, str(info.value))
    assert CALLS == []


def test_clear_bad_check_errors_mode():
    with pytest.raises(VerlConfigError, match="check_errors must be 'node' or 'end'"):
        build_dataflow(nodes=[double]).run({"x": 1.0}, check_errors="never")


@pytest.mark.parametrize("ret, parts", [({"a": 1, "c": 2}, ["keys ['a', 'c']", "['a', 'b']"]),
                                        ({"a": 1, "b": 2, "c": 3}, ["keys ['a', 'b', 'c']", "['a', 'b']"]),
                                        ((1, 2, 3), ["a tuple of length 3", "['a', 'b']"]),
                                        (None, ["NoneType", "['a', 'b']"])],
                         ids=["wrong_key", "extra_key", "long_tuple", "none"])
def test_clear_node_returning_undeclared_outputs(ret, parts):
    @DataflowNode(input_keys=["x"], output_keys=["a", "b"])
    def bad(x):
        return ret

    with pytest.raises(VerlRuntimeError) as info:
        build_dataflow(nodes=[bad]).run({"x": 1})
    assert "node 'bad'" in str(info.value) and "rank 0" in str(info.value)
    for p in parts:
        assert p in str(info.value), (p, str(info.value))


def test_behaves_single_output_may_be_a_dict():
    @DataflowNode(input_keys=["x"], output_keys=["metrics"])
    def report(x):
        return {"loss": x}

    assert build_dataflow(nodes=[report]).run({"x": 1})["metrics"] == {"loss": 1}


def test_clear_two_outputs_returned_as_one_value():
    @DataflowNode(input_keys=["x"], output_keys=["a", "b"])
    def pair(x):
        return torch.zeros(3)

    with pytest.raises(VerlRuntimeError, match=r"node 'pair'.*returned Tensor but declares 2 output_keys"):
        build_dataflow(nodes=[pair]).run({"x": 1})


def test_behaves_good_edge_configs_build():
    df = build_dataflow(nodes=[double, plus_one], configs={
        "double": {"timeout_s": 0, "retries": 0, "retry_backoff_s": 0, "cpu_offload": False, "device_map": [0, 1]},
        "plus_one": {"timeout_s": 2.5, "retry_on": TimeoutError, "bias": 0.0}}, world_size=2)
    assert df.entry("double").config.timeout_s == 0.0 and df.entry("plus_one").config.timeout_s == 2.5
    assert df.entry("plus_one").config.retry_on == (TimeoutError,)
