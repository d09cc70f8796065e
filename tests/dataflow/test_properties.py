"""Property tests on random DAGs: execution order, injection, and invalid graphs failing at build time."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl import DataflowNode, build_dataflow, inject_node
from verl.errors import VerlConfigError

SETTINGS = settings(max_examples=40, deadline=2000, suppress_health_check=[HealthCheck.too_slow])


def _make_node(name: str, inputs: list[str], outputs: list[str], log: list):
    def fn(**kw):
        log.append(name)
        return {k: (name, tuple(sorted(kw))) for k in outputs} if len(outputs) > 1 else (name, tuple(sorted(kw)))

    fn.__name__ = name
    return DataflowNode(input_keys=inputs, output_keys=outputs)(fn)


@st.composite
def dags(draw, min_nodes=2, max_nodes=8):
    """A random DAG: node i outputs key k{i} and reads keys of earlier nodes (and maybe the input 'x');
    explicit dependencies also point from earlier to later nodes. Returned in a shuffled listing order."""
    n = draw(st.integers(min_nodes, max_nodes))
    reads = [sorted(draw(st.sets(st.integers(0, i - 1), max_size=3))) if i else [] for i in range(n)]
    deps = [sorted(draw(st.sets(st.integers(0, i - 1), max_size=2))) if i else [] for i in range(n)]
    uses_x = [draw(st.booleans()) or not reads[i] for i in range(n)]
    perm = draw(st.permutations(range(n)))
    return {"n": n, "reads": reads, "deps": deps, "uses_x": uses_x, "perm": list(perm)}


def _build_spec(spec, log):
    nodes = {}
    for i in spec["perm"]:
        inputs = [f"k{j}" for j in spec["reads"][i]] + (["x"] if spec["uses_x"][i] else [])
        nodes[f"n{i}"] = _make_node(f"n{i}", inputs, [f"k{i}"], log)
    dependencies = {f"n{i}": [f"n{j}" for j in spec["deps"][i]] for i in range(spec["n"]) if spec["deps"][i]}
    return nodes, dependencies


def _intended_edges(spec):
    return {(f"n{j}", f"n{i}") for i in range(spec["n"]) for j in spec["reads"][i] + spec["deps"][i]}


def _reachable(edges, a, b):
    succ = {}
    for u, v in edges:
        succ.setdefault(u, []).append(v)
    stack, seen = [a], set()
    while stack:
        for v in succ.get(stack.pop(), ()):
            if v == b:
                return True
            if v not in seen:
                seen.add(v)
                stack.append(v)
    return False


@SETTINGS
@given(dags())
def test_execution_respects_every_dependency(spec):
    log: list[str] = []
    nodes, deps = _build_spec(spec, log)
    flow = build_dataflow(nodes=nodes, dependencies=deps, inputs=["x"])
    out = flow.run({"x": 0})
    assert sorted(log) == sorted(nodes) and len(log) == len(set(log))
    pos = {n: i for i, n in enumerate(log)}
    for u, v in _intended_edges(spec):
        assert pos[u] < pos[v], (u, v, log)
    assert set(flow.edges) == _intended_edges(spec)
    for i in range(spec["n"]):  # every node saw exactly its declared inputs
        expected = sorted([f"k{j}" for j in spec["reads"][i]] + (["x"] if spec["uses_x"][i] else []))
        assert out[f"k{i}"] == (f"n{i}", tuple(expected))
    again: list[str] = []
    nodes2, _ = _build_spec(spec, again)
    build_dataflow(nodes=nodes2, dependencies=deps).run({"x": 0})
    assert again == log  # deterministic order


@SETTINGS
@given(dags(min_nodes=3), st.data())
def test_injection_keeps_all_other_edges(spec, data):
    log: list[str] = []
    nodes, deps = _build_spec(spec, log)
    base = build_dataflow(nodes=nodes, dependencies=deps, inputs=["x"])
    pairs = [(u, v) for u in base.names for v in base.names if u != v and _reachable(base.edges, u, v)]
    if not pairs:
        return
    after, before = data.draw(st.sampled_from(sorted(pairs)))
    i_after = int(after[1:])
    replaced = data.draw(st.sampled_from([f"k{i_after}", "x"]))
    injected = _make_node("inj", [replaced], [replaced, "extra"], log)
    base_edges, base_order = set(base.edges), base.order
    flow = inject_node(base_dataflow=base, node=injected, after=after, before=before)
    assert set(base.edges) == base_edges and base.order == base_order and "inj" not in base
    assert base_edges <= set(flow.edges)
    assert {(after, "inj"), ("inj", before)} <= set(flow.edges)
    below = {before} | {v for v in flow.names if _reachable(base.edges, before, v)}
    for name in base.names:
        for key in flow.entry(name).node.input_keys:
            if key != replaced:
                assert flow.producer(name, key) == base.producer(name, key)
            elif name in below and base.producer(name, key) in (None, *[u for u in base.names
                                                                    if _reachable(base.edges, u, after) or u == after]):
                assert flow.producer(name, key) == "inj"
            else:
                assert flow.producer(name, key) == base.producer(name, key)
    log.clear()
    flow.run({"x": 0})
    pos = {n: i for i, n in enumerate(log)}
    for u, v in flow.edges:
        assert pos[u] < pos[v]


MUTATIONS = ["cycle", "missing_key", "two_producers", "unknown_dependency", "device_map", "unknown_config",
             "inject_unreachable", "inject_unknown"]


@SETTINGS
@given(dags(min_nodes=2), st.sampled_from(MUTATIONS), st.data())
def test_invalid_graphs_fail_at_build_time(spec, mutation, data):
    log: list[str] = []
    nodes, deps = _build_spec(spec, log)
    configs: dict = {}
    names = sorted(nodes)
    edges = _intended_edges(spec)
    if mutation == "cycle":
        pairs = sorted(p for p in ((u, v) for u in names for v in names) if _reachable(edges, *p))
        if not pairs:  # no edge at all: make one and close it
            deps = {"n1": ["n0"], "n0": ["n1"]}
        else:
            u, v = data.draw(st.sampled_from(pairs))
            deps = {**deps, u: [*deps.get(u, []), v]}
        match = "cycle"
    elif mutation == "missing_key":
        victim = data.draw(st.sampled_from(names))
        nodes[victim] = _make_node(victim, [*nodes[victim].input_keys, "nobody_makes_this"],
                                   list(nodes[victim].output_keys), log)
        match = "needs key 'nobody_makes_this'"
    elif mutation == "two_producers":
        a, b = data.draw(st.lists(st.sampled_from(names), min_size=2, max_size=2, unique=True))
        nodes[b] = _make_node(b, list(nodes[b].input_keys), [*nodes[b].output_keys, f"k{a[1:]}"], log)
        match = "produced by two nodes|cycle"   # the duplicate may also close a loop; both are build errors
    elif mutation == "unknown_dependency":
        victim = data.draw(st.sampled_from(names))
        deps = {**deps, victim: ["ghost"]}
        match = "names 'ghost', which is not in the dataflow"
    elif mutation == "device_map":
        victim = data.draw(st.sampled_from(names))
        configs = {victim: {"device_map": [0, data.draw(st.integers(2, 9))]}}
        match = "device_map names rank"
    elif mutation == "unknown_config":
        configs = {"ghost_node": {}}
        match = "configs names node 'ghost_node'"
    else:
        match = "does not run after|is not a node"
    with pytest.raises(VerlConfigError, match=match):
        flow = build_dataflow(nodes=nodes, configs=configs, dependencies=deps, inputs=["x"], world_size=2)
        extra = _make_node("inj", ["x"], ["y"], log)
        if mutation == "inject_unreachable":
            pairs = sorted((u, v) for u in names for v in names if u != v and not _reachable(flow.edges, u, v))
            after, before = data.draw(st.sampled_from(pairs)) if pairs else (names[0], names[0] + "_nope")
            inject_node(base_dataflow=flow, node=extra, after=after, before=before)
        else:
            inject_node(base_dataflow=flow, node=extra, after="ghost", before=names[0])
    assert log == []  # nothing ran
