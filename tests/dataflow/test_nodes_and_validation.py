"""Node conventions, build-time validation messages, retries, offload, hooks and the node context."""

from __future__ import annotations

import pytest
import torch

from verl import CustomNode, DataflowNode, VerlRuntimeError, build_dataflow, inject_node
from verl.dataflow import NodeContext, TransientError, mark_transient
from verl.errors import VerlConfigError


@DataflowNode(input_keys=["x"], output_keys=["a", "b"])
def as_tuple(x):
    return x + 1, x + 2


@DataflowNode(input_keys=["x"], output_keys=["c", "d"])
def as_dict(x):
    return {"d": x * 2, "c": x * 3}


@DataflowNode(input_keys=["a", "c"], output_keys=["s"])
def add(a, c):
    return a + c


@DataflowNode(input_keys=["s"], output_keys=[])
def sink(s):
    return None


def test_return_conventions():
    out = build_dataflow(nodes=[as_tuple, as_dict, add, sink]).run({"x": 1})
    assert (out["a"], out["b"], out["c"], out["d"], out["s"]) == (2, 3, 3, 2, 5)


@pytest.mark.parametrize("ret,match", [
    ((1,), r"a tuple of length 1 but declares 2 output_keys \['a', 'b'\]"),
    ({"a": 1, "z": 2}, r"returned a dict with keys \['a', 'z'\] but declares output_keys \['a', 'b'\]"),
    (5, r"returned int but declares 2 output_keys"),
])
def test_undeclared_outputs_fail_at_run_time(ret, match):
    @DataflowNode(input_keys=["x"], output_keys=["a", "b"])
    def bad(x):
        return ret

    with pytest.raises(VerlRuntimeError, match=match) as info:
        build_dataflow(nodes=[bad]).run({"x": 0})
    assert info.value.node == "bad"


def test_custom_node_returning_other_keys_fails():
    def filt(reward, flag=False):
        if flag:
            return {"reward": reward, "extra": 1}
        return {"reward": reward}

    with pytest.raises(VerlConfigError, match="returns different keys on different paths"):
        CustomNode()(filt)

    @CustomNode(output_keys=["reward"])
    def dyn(reward):
        return {f"re{'ward'}": reward, "oops": 1}

    with pytest.raises(VerlRuntimeError, match=r"returned \['oops', 'reward'\] but its outputs are \['reward'\]"):
        build_dataflow(nodes=[dyn]).run({"reward": 1})


def test_custom_node_settings_are_overridable_per_node():
    @CustomNode()
    def scale(value, factor=2.0, ctx=None):
        return dict(scaled=value * factor, seen=ctx.settings["factor"])

    assert scale.input_keys == ("value",)
    out = build_dataflow(nodes=[scale]).run({"value": 3.0})
    assert out["scaled"] == 6.0 and out["seen"] == 2.0
    out = build_dataflow(nodes=[scale], configs={"scale": {"factor": 10.0}}).run({"value": 3.0})
    assert out["scaled"] == 30.0 and out["seen"] == 10.0
    with pytest.raises(VerlConfigError, match=r"unknown config key 'factr' \(did you mean 'factor'\?\)"):
        build_dataflow(nodes=[scale], configs={"scale": {"factr": 1.0}})


def test_decoration_errors():
    with pytest.raises(VerlConfigError, match="must be a list of strings"):
        DataflowNode(input_keys="x", output_keys=["y"])(lambda x: x)
    with pytest.raises(VerlConfigError, match=r"parameters \['other'\] are neither in input_keys"):
        @DataflowNode(input_keys=["x"], output_keys=["y"])
        def f(x, other):
            return x

    with pytest.raises(VerlConfigError, match="returns something other than a dict literal"):
        @CustomNode()
        def g(x):
            return x

    with pytest.raises(VerlConfigError, match="plain function; decorate it"):
        build_dataflow(nodes=[lambda x: x])


def test_positional_inputs_when_names_differ():
    @DataflowNode(input_keys=["old_log_probs", "log_probs"], output_keys=["ratio"])
    def ratio(old, new):
        return new - old

    assert build_dataflow(nodes=[ratio]).run({"old_log_probs": 1.0, "log_probs": 3.0})["ratio"] == 2.0

    @DataflowNode(input_keys=["x", "y"], output_keys=["z"])
    def scaled(a, b, ctx, scale=2):
        return (a + b) * scale + ctx.rank

    assert build_dataflow(nodes=[scaled], configs={"scaled": {"scale": 3}}).run({"x": 1, "y": 2})["z"] == 9
    with pytest.raises(VerlConfigError, match="context parameter 'ctx' must come after them"):
        DataflowNode(input_keys=["x", "y"], output_keys=["z"])(lambda ctx, a, b: a)


# ---- graph validation ----------------------------------------------------------------------------------------
@DataflowNode(input_keys=["q"], output_keys=["p"])
def p_from_q(q):
    return q


@DataflowNode(input_keys=["p"], output_keys=["q"])
def q_from_p(p):
    return p


def test_cycle_is_printed():
    with pytest.raises(VerlConfigError, match=r"cycle: p_from_q -\[key 'p'\] -> q_from_p -\[key 'q'\] -> p_from_q"):
        build_dataflow(nodes=[p_from_q, q_from_p])
    with pytest.raises(VerlConfigError, match=r"cycle: .*dependencies\['as_tuple'\]"):
        build_dataflow(nodes=[as_tuple, add], dependencies={"as_tuple": ["add"]}, inputs=["x", "c"])


def test_unknown_names_suggest_the_nearest():
    with pytest.raises(VerlConfigError,
                       match=r"names 'as_tupel', which is not in the dataflow \(did you mean 'as_tuple'"):
        build_dataflow(nodes=[as_tuple, add], dependencies={"add": ["as_tupel"]})
    with pytest.raises(VerlConfigError, match=r"configs names node 'ad'.*did you mean 'add'"):
        build_dataflow(nodes=[as_tuple, add], configs={"ad": {}})
    flow = build_dataflow(nodes=[as_tuple, as_dict, add])
    with pytest.raises(VerlConfigError, match=r"after='as_dic' is not a node.*did you mean 'as_dict'"):
        inject_node(base_dataflow=flow, node=sink, after="as_dic", before="add")
    with pytest.raises(VerlConfigError, match=r"unknown engine 'vlm' \(did you mean 'vllm'\?\)"):
        build_dataflow(nodes=[add], configs={"add": {"engine": "vlm"}})


def test_missing_key_names_who_needs_it_and_who_could_produce_it():
    @DataflowNode(input_keys=["rewards"], output_keys=["adv"])
    def advantage(rewards):
        return rewards

    @DataflowNode(input_keys=["x"], output_keys=["reward"])
    def score(x):
        return x

    with pytest.raises(VerlConfigError) as info:
        build_dataflow(nodes=[score, advantage], inputs=["x"])
    msg = str(info.value)
    assert "node 'advantage' needs key 'rewards'" in msg and "Did you mean 'reward' (output of node 'score')" in msg
    flow = build_dataflow(nodes=[score, advantage])   # without declared inputs the check happens at run time
    with pytest.raises(VerlConfigError, match="node 'advantage' needs key 'rewards'"):
        flow.run({"x": 1})


def test_two_producers_of_one_key():
    @DataflowNode(input_keys=["x"], output_keys=["a"])
    def other_a(x):
        return x

    with pytest.raises(VerlConfigError, match="key 'a' is produced by two nodes, 'as_tuple' and 'other_a'"):
        build_dataflow(nodes=[as_tuple, other_a])


def test_before_must_be_reachable_after_after():
    flow = build_dataflow(nodes=[as_tuple, as_dict, add, sink])
    with pytest.raises(VerlConfigError, match=r"'as_dict' does not run after 'as_tuple'.*\['add', 'sink'\]"):
        inject_node(base_dataflow=flow, node=p_from_q, after="as_tuple", before="as_dict")
    with pytest.raises(VerlConfigError, match="already has a node named 'add'"):
        inject_node(base_dataflow=flow, node=add, after="as_tuple", before="sink")


def test_device_map_outside_the_world():
    with pytest.raises(VerlConfigError, match=r"node 'add': device_map names rank\(s\) \[4\] but the world has 4"):
        build_dataflow(nodes=[add], configs={"add": {"device_map": ["cuda:0", "cuda:4"]}}, world_size=4)
    with pytest.raises(VerlConfigError, match="is not an int rank or 'cuda:i'"):
        build_dataflow(nodes=[add], configs={"add": {"device_map": ["gpu0"]}}, world_size=4)


def test_order_is_deterministic_and_explicit_dependencies_add_ordering():
    @DataflowNode(input_keys=["x"], output_keys=["l1"])
    def left(x):
        return x

    @DataflowNode(input_keys=["x"], output_keys=["r1"])
    def right(x):
        return x

    assert build_dataflow(nodes=[left, right]).order == ("left", "right")
    assert build_dataflow(nodes=[right, left]).order == ("right", "left")
    assert build_dataflow(nodes=[left, right], dependencies={"left": ["right"]}).order == ("right", "left")


# ---- runtime behaviour -----------------------------------------------------------------------------------------
def test_the_runtime_caches_one_plan_per_dataflow_without_keeping_it_alive():
    import gc
    import weakref

    from verl.dataflow import plan as plans
    flow = build_dataflow(nodes=[as_tuple, as_dict, add])
    assert flow.run({"x": 1})["s"] == 2 + 3
    plan = plans.plan_for(flow)
    assert flow.run({"x": 2})["s"] == 3 + 6 and plans.plan_for(flow) is plan  # compiled once
    assert flow in plans.PLANS
    ref = weakref.ref(flow)
    del flow, plan
    gc.collect()
    assert ref() is None, "the runtime's plan cache keeps the dataflow alive"


def test_retries_only_transient_errors_with_backoff():
    calls = []

    @DataflowNode(input_keys=["x"], output_keys=["y"])
    def flaky(x, ctx=None):
        calls.append(ctx.attempt)
        if ctx.attempt < 2:
            raise TransientError("engine busy")
        return x

    events = []

    class Hook:
        def on_node_end(self, event):
            events.append(event.retries)

    flow = build_dataflow(nodes=[flaky], configs={"flaky": dict(retries=3, retry_backoff_s=0.0)})
    assert flow.run({"x": 7}, hooks=[Hook()])["y"] == 7
    assert calls == [0, 1, 2] and events == [2]

    calls.clear()
    with pytest.raises(VerlRuntimeError, match="TransientError: engine busy") as info:
        build_dataflow(nodes=[flaky], configs={"flaky": dict(retries=1, retry_backoff_s=0.0)}).run({"x": 7})
    assert calls == [0, 1] and isinstance(info.value.__cause__, TransientError)

    @DataflowNode(input_keys=["x"], output_keys=["y"])
    def broken(x):
        calls.append("broken")
        raise ValueError("a bug, not transient")

    calls.clear()
    with pytest.raises(VerlRuntimeError, match="ValueError: a bug"):
        build_dataflow(nodes=[broken], configs={"broken": dict(retries=5)}).run({"x": 1})
    assert calls == ["broken"]

    @DataflowNode(input_keys=["x"], output_keys=["y"])
    def timeouts(x, ctx=None):
        if ctx.attempt == 0:
            raise TimeoutError("slow")
        if ctx.attempt == 1:
            raise mark_transient(RuntimeError("marked"))
        return x

    flow = build_dataflow(nodes=[timeouts], configs={"timeouts": dict(retries=2, retry_backoff_s=0.0,
                                                                      retry_on=[TimeoutError])})
    assert flow.run({"x": 3})["y"] == 3


def test_cpu_offload_moves_modules_around_the_call():
    log = []

    class Engine:
        def onload(self, device):
            log.append(("onload", str(device)))

        def offload(self):
            log.append(("offload",))

    model = torch.nn.Linear(2, 2)

    @DataflowNode(input_keys=["engine_obj", "model"], output_keys=["y"])
    def use(engine_obj, model, ctx: NodeContext = None):
        log.append(("run", next(model.parameters()).device.type))
        return 1

    flow = build_dataflow(nodes=[use], configs={"use": dict(cpu_offload=True, device_map=["cpu:0"])})
    flow.run({"engine_obj": Engine(), "model": model})
    assert log == [("onload", "cpu"), ("run", "cpu"), ("offload",)]
    log.clear()
    build_dataflow(nodes=[use]).run({"engine_obj": Engine(), "model": model})
    assert log == [("run", "cpu")]


def test_hooks_and_context():
    seen = []

    class Hook:
        def on_node_start(self, e):
            seen.append(("start", e.node, sorted(e.inputs)))

        def on_node_end(self, e):
            seen.append(("end", e.node, sorted(e.outputs), e.duration_s >= 0))

    @DataflowNode(input_keys=["x"], output_keys=["info"])
    def where(x, ctx):
        return dict(rank=ctx.rank, ranks=ctx.ranks, device=str(ctx.device), engine=ctx.engine,
                    dp=(ctx.dp_rank, ctx.dp_size), leader=ctx.is_leader, name=ctx.name)

    out = build_dataflow(nodes=[where], configs={"where": dict(engine="rule")}).run({"x": 0}, hooks=[Hook()])
    assert out["info"] == dict(rank=0, ranks=(0,), device="cpu", engine="rule", dp=(0, 1), leader=True,
                               name="where")
    assert seen == [("start", "where", ["x"]), ("end", "where", ["info"], True)]


@pytest.mark.cuda
def test_cpu_offload_brings_a_module_to_the_gpu_for_the_call():
    model = torch.nn.Linear(4, 4)

    @DataflowNode(input_keys=["model"], output_keys=["where"])
    def forward(model, ctx):
        return next(model.parameters()).device.type, ctx.device.type

    flow = build_dataflow(nodes=[forward], configs={"forward": dict(cpu_offload=True, device_map=["cuda:0"])})
    assert flow.run({"model": model})["where"] == ("cuda", "cuda")
    assert next(model.parameters()).device.type == "cpu"


def test_dict_form_takes_configs_and_inputs():
    from verl.dataflow import Dataflow

    @CustomNode()
    def scale(value, factor=2.0, ctx=None):
        return dict(scaled=value * factor, engine=ctx.engine)

    flow = Dataflow.from_dict({"scale": scale, "configs": {"scale": {"factor": 5.0, "engine": "rule"}},
                               "inputs": ["value"]})
    assert flow.run({"value": 2.0}) == {"value": 2.0, "scaled": 10.0, "engine": "rule"}
    with pytest.raises(VerlConfigError, match=r"node 'scale' needs key 'value'.*Did you mean 'values' \(an input\)"):
        Dataflow.from_dict({"scale": scale, "inputs": ["values"]})


def test_decorated_nodes_are_registered_by_reference():
    from verl.dataflow import get_node, registered_nodes

    ref = f"{__name__}:as_tuple"
    assert registered_nodes()[ref] is as_tuple and get_node(ref) is as_tuple
    assert get_node("tests.dataflow.test_spec_examples:safe_reward_filter").output_keys == ("reward", "is_safe")
    with pytest.raises(VerlConfigError, match="has no dataflow node 'as_tupl'.*did you mean 'as_tuple'"):
        get_node(f"{__name__}:as_tupl")
    with pytest.raises(VerlConfigError, match="must look like 'package.module:function'"):
        get_node("as_tuple")


def test_a_failing_hook_fails_its_node():
    class Bad:
        def on_node_end(self, event):
            raise RuntimeError("metrics sink down")

    with pytest.raises(VerlRuntimeError, match="on_node_end hook: RuntimeError: metrics sink down") as info:
        build_dataflow(nodes=[as_tuple]).run({"x": 1}, hooks=[Bad()])
    assert info.value.node == "as_tuple"
