"""Dataflow graphs: building, validation, injection and the deterministic run order.

A dataflow is a set of named nodes plus edges. Edges come from keys (the producer of a key runs before every
node that reads it) and from written dependencies (``{"score": ["generate"]}``: score runs after generate).
Every graph error is found here, before any node runs, and the message says what to change.

Keys are bound per consumer: each input of each node is bound to one producer node (or to the run's inputs).
That is what lets `inject_node` replace a key for the nodes downstream of the injection point only.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from verl.dataflow.config import NodeConfig, make_config, world_size_now
from verl.dataflow.node import Node, NodeEntry, as_node
from verl.dataflow.execute import execute, flush, queued_values, requeue
from verl.dataflow.plan import reachable
from verl.dataflow.state import RunState
from verl.errors import VerlConfigError, nearest

RESERVED_DICT_KEYS = ("dependencies", "configs", "inputs")


class Dataflow:
    """A validated, immutable dataflow. Build with `build_dataflow`, `Dataflow.from_dict` or `inject_node`.

    It only describes the graph; `verl.dataflow.plan` compiles and caches what running it needs (weakly
    referenced, hence ``__weakref__``)."""

    __slots__ = ("_entries", "_index", "_bindings", "_edges", "_exports", "_order", "_world_size", "_inputs",
                 "_stages", "__weakref__")

    def __init__(self, entries: Sequence[NodeEntry], bindings: Mapping[str, Mapping[str, str | None]],
                 edges: Mapping[tuple[str, str], str], exports: Mapping[str, str], world_size: int,
                 inputs: frozenset[str] | None):
        self._entries = {e.name: e for e in entries}
        self._index = {e.name: i for i, e in enumerate(entries)}
        self._bindings = {n: dict(b) for n, b in bindings.items()}
        self._edges = dict(edges)
        self._exports = dict(exports)
        self._world_size = world_size
        self._inputs = inputs
        _check_lags(self)
        self._order = _topological_order(self)
        _check_placement(self)
        self._stages = _stages(self)
        if inputs is not None:
            self.check_inputs(inputs)

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, world_size: int | None = None) -> "Dataflow":
        """A dataflow from the dict form: ``{name: node, ..., "dependencies": {...}}``, optionally with
        ``"configs": {name: {...}}`` and ``"inputs": [...]`` (the keys the caller will pass to run)."""
        if isinstance(d, Dataflow):
            return d
        if not isinstance(d, Mapping):
            raise VerlConfigError(f"a dataflow dict must be a mapping of names to nodes, got {type(d).__name__}")
        nodes = {k: as_node(v, f"dataflow entry '{k}'") for k, v in d.items() if k not in RESERVED_DICT_KEYS}
        return _build(nodes, d.get("configs"), d.get("dependencies"), inputs=d.get("inputs"),
                      world_size=world_size)

    # ---- inspection ---------------------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        """Node names in the order they were given."""
        return tuple(self._entries)

    @property
    def order(self) -> tuple[str, ...]:
        """Node names in run order (deterministic: dependencies first, ties broken by the given order)."""
        return self._order

    @property
    def edges(self) -> list[tuple[str, str]]:
        """(before, after) pairs: every ordering constraint, from keys, dependencies and injections."""
        return list(self._edges)

    def edge_reason(self, before: str, after: str) -> str:
        return self._edges[(before, after)]

    @property
    def dependencies(self) -> dict[str, list[str]]:
        """For each node, the nodes it waits for."""
        deps: dict[str, list[str]] = {n: [] for n in self._entries}
        for u, v in self._edges:
            deps[v].append(u)
        return {n: sorted(p, key=self._index.__getitem__) for n, p in deps.items()}

    @property
    def entries(self) -> tuple[NodeEntry, ...]:
        """The nodes with their configs, in the order they were given."""
        return tuple(self._entries.values())

    def entry(self, name: str) -> NodeEntry:
        if name not in self._entries:
            raise VerlConfigError(f"no node named '{name}' in this dataflow{nearest(name, self._entries, 'nodes')}")
        return self._entries[name]

    def config(self, name: str) -> NodeConfig:
        return self.entry(name).config

    def producer(self, consumer: str, key: str) -> str | None:
        """The node whose ``key`` the node ``consumer`` reads (None: it reads the run's inputs)."""
        return self._bindings[self.entry(consumer).name][key]

    def lag(self, consumer: str, key: str) -> int:
        """How many runs back the value of ``key`` that ``consumer`` reads comes from (0: this run's)."""
        return self.entry(consumer).config.lag.get(key, 0)

    @property
    def carried(self) -> dict[tuple[str, str], int]:
        """(producer, key) -> the most runs back any node reads it: what a `RunState` keeps between runs."""
        out: dict[tuple[str, str], int] = {}
        for e in self._entries.values():
            for key, k in e.config.lag.items():
                p = self._bindings[e.name][key]
                out[(p, key)] = max(k, out.get((p, key), 0))
        return out

    @property
    def queued(self) -> list[tuple[str, str, str, int]]:
        """(producer, key, consumer, size) of every input read through a queue (`NodeConfig.queue`)."""
        return [(self._bindings[e.name][k], k, e.name, size) for e in self._entries.values()
                for k, size in e.config.queue.items()]

    @property
    def stages(self) -> tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]:
        """(nodes in run order, ranks) of each stage: the parts that queues split the dataflow into, each run by
        its own ranks at its own pace. One stage (every node, ranks () meaning every rank) without queues."""
        return self._stages

    @property
    def input_keys(self) -> tuple[str, ...]:
        """Keys the run must be given: inputs of some node that no upstream node produces."""
        seen: dict[str, None] = {}
        for n in self._order:
            for k, p in self._bindings[n].items():
                if p is None:
                    seen.setdefault(k)
        return tuple(seen)

    @property
    def output_keys(self) -> tuple[str, ...]:
        """Keys the nodes produce (each under its final producer)."""
        return tuple(self._exports)

    @property
    def exports(self) -> Mapping[str, str]:
        """For each key the nodes produce, the node whose value of it the run returns (the last in a chain of
        injected replacements). Read-only."""
        return MappingProxyType(self._exports)

    @property
    def world_size(self) -> int:
        return self._world_size

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        lines = [f"Dataflow({len(self)} nodes, world_size={self._world_size})"]
        for n in self._order:
            e = self._entries[n]
            deps = self.dependencies[n]
            where = "all ranks" if e.config.device_map is None else f"ranks {list(e.config.device_map)}"
            lines.append(f"  {n}: {list(e.node.input_keys)} -> {list(e.node.output_keys)}"
                         f"{'  after ' + ', '.join(deps) if deps else ''}  [{e.config.engine}, {where}]")
        return "\n".join(lines)

    # ---- validation against a run's inputs -------------------------------------------------------------------
    def check_inputs(self, available: Iterable[str], only: Iterable[str] | None = None) -> None:
        """Raises VerlConfigError naming every key some node (of ``only``, default all) needs that neither a
        node nor ``available`` gives."""
        available = set(available)
        only = set(only) if only is not None else None
        produced = {k: e.name for e in self._entries.values() for k in e.node.output_keys}
        problems = []
        for n in self._order:
            if only is not None and n not in only:
                continue
            for k, p in self._bindings[n].items():
                if p is None and k not in available:
                    problems.append(_missing_key_message(n, k, produced, available))
        if problems:
            raise VerlConfigError("missing keys:\n  " + "\n  ".join(problems))

    # ---- execution (see verl.dataflow.execute) -------------------------------------------------------------
    def new_state(self, initial: Mapping[str, Any] | None = None) -> RunState:
        """The carried values of this dataflow's lagged inputs, empty or seeded (see `RunState`)."""
        return RunState(self, initial)

    def run(self, inputs: Mapping[str, Any], *, trace: str | None = None, hooks: Sequence[Any] = (),
            check_errors: str = "node", state: RunState | None = None) -> dict[str, Any]:
        """Runs the dataflow on this rank and returns the inputs plus every output this rank produced or received.

        Under torch.distributed every rank calls ``run`` with its own inputs; a node runs only on the ranks of
        its device map and data moving between differently placed nodes is redistributed. ``trace`` writes a
        Chrome trace-event JSON file (all ranks merged, by rank 0). ``hooks`` are objects with optional
        ``on_node_start(event)`` / ``on_node_end(event)`` methods, and ``on_transfer(name, rank, start_s, end_s,
        info)`` for each value this rank moved between rank sets. ``check_errors="node"`` makes the ranks of
        each multi-rank node agree that nobody has failed before it starts (one tiny all-reduce per node);
        ``"end"`` checks only once per run. ``state`` (from `new_state`) carries the values of lagged inputs
        from run to run; a dataflow with lagged inputs needs one.
        """
        return execute(self, inputs, trace=trace, hooks=hooks, check_errors=check_errors, state=state)

    def flush(self, timeout_s: float | None = None) -> None:
        """After a queue producer's last run, on its ranks: waits until every value it made has been sent (see
        `NodeConfig.queue`); at most ``timeout_s`` (default: the job's collective timeout)."""
        flush(self, timeout_s)

    def queued_values(self, last: int) -> dict[str, list]:
        """On a queue producer's ranks: this rank's shares of what its last ``last`` runs put into each queue
        (``{"producer/key": [oldest, ..., newest]}``), for a checkpoint; ``requeue`` puts them back."""
        return queued_values(self, last)

    def requeue(self, values: Mapping[str, list]) -> int:
        """In a resumed producer, before its first run: puts what ``queued_values`` saved into the queues again, in
        order (collective over the producer's ranks); returns the number of runs' values."""
        return requeue(self, values)


def _missing_key_message(node: str, key: str, produced: Mapping[str, str], available: set[str]) -> str:
    import difflib
    hints = []
    for k in difflib.get_close_matches(key, list(produced), n=2, cutoff=0.6):
        hints.append(f"'{k}' (output of node '{produced[k]}')")
    for k in difflib.get_close_matches(key, sorted(available), n=2, cutoff=0.6):
        hints.append(f"'{k}' (an input)")
    could = f" Did you mean {' or '.join(hints)}?" if hints else ""
    given = f"inputs given: {sorted(available)}" if available else "no inputs were given"
    return (f"node '{node}' needs key '{key}', which no node produces and the inputs do not contain ({given})."
            f"{could} Otherwise pass '{key}' in the inputs or add a node with output_keys=['{key}'].")


# ------------------------------------------------------------------------------------------------------------
def build_dataflow(nodes: Sequence[Node] | Mapping[str, Node], configs: Mapping[str, Any] | None = None,
                   dependencies: Mapping[str, Sequence[str] | str] | None = None, *,
                   inputs: Iterable[str] | None = None, world_size: int | None = None) -> Dataflow:
    """Builds and validates a dataflow.

    ``nodes``: decorated functions (named after the function) or a ``{name: node}`` dict. ``configs``: per node
    name, a dict of `NodeConfig` fields (device_map, engine, cpu_offload, retries, ...) and node settings.
    ``dependencies``: ``{node: [nodes it runs after]}`` on top of those inferred from keys. ``inputs``: the keys
    run() will be given; when set, a key nobody produces is an error now rather than at run time.
    ``world_size``: defaults to torch.distributed's (or torchrun's WORLD_SIZE, else 1).
    """
    if isinstance(nodes, Mapping):
        named = {k: as_node(v, f"node '{k}'") for k, v in nodes.items()}
    else:
        if isinstance(nodes, Node) or not isinstance(nodes, Iterable):
            raise VerlConfigError("nodes must be a list of nodes (or a {name: node} dict); wrap a single node "
                                  "in a list")
        named = {}
        for n in nodes:
            node = as_node(n, "build_dataflow(nodes=...)")
            if node.name in named:
                raise VerlConfigError(f"two nodes are named '{node.name}'; pass nodes as a dict "
                                      f"{{'{node.name}_a': ..., '{node.name}_b': ...}} to name them apart")
            named[node.name] = node
    return _build(named, configs, dependencies, inputs=inputs, world_size=world_size)


def _build(nodes: Mapping[str, Node], configs, dependencies, *, inputs, world_size) -> Dataflow:
    if not nodes:
        raise VerlConfigError("a dataflow needs at least one node")
    for name in nodes:
        if not isinstance(name, str) or not name:
            raise VerlConfigError(f"node names must be non-empty strings, got {name!r}")
    configs = dict(configs or {})
    for name in configs:
        if name not in nodes:
            raise VerlConfigError(f"configs names node '{name}', which is not in the dataflow"
                                  f"{nearest(name, nodes, 'nodes')}")
    entries = [NodeEntry(name, node, make_config(name, configs.get(name), node.settings))
               for name, node in nodes.items()]
    producers: dict[str, str] = {}
    for e in entries:
        for k in e.node.output_keys:
            if k in producers:
                raise VerlConfigError(
                    f"key '{k}' is produced by two nodes, '{producers[k]}' and '{e.name}'; rename one of the "
                    f"outputs, or use inject_node to replace '{k}' for the nodes downstream of a point")
            producers[k] = e.name
    # A node that reads a key it also writes transforms the run's input of that name (reward -> reward), unless
    # it reads it from an earlier run (lag): then it reads its own earlier output (a counter, a running mean).
    bindings = {e.name: {k: (p if (p := producers.get(k)) != e.name or k in e.config.lag else None)
                         for k in e.node.input_keys} for e in entries}
    edges: dict[tuple[str, str], str] = {}
    for e in entries:
        for k, p in bindings[e.name].items():
            # a lagged value exists before the run starts; a queued one comes from the producer's own runs
            if p is not None and k not in e.config.lag and k not in e.config.queue:
                edges.setdefault((p, e.name), f"key '{k}'")
    for u, v in _explicit_edges(dependencies, nodes):
        edges.setdefault((u, v), f"dependencies['{v}']")
    ws = world_size if world_size is not None else world_size_now()
    return Dataflow(entries, bindings, edges, dict(producers), ws,
                    frozenset(inputs) if inputs is not None else None)


def _explicit_edges(dependencies, nodes: Mapping[str, Node]) -> list[tuple[str, str]]:
    if dependencies is None:
        return []
    if not isinstance(dependencies, Mapping):
        raise VerlConfigError(f"dependencies must be a dict {{node: [nodes it runs after]}}, got "
                              f"{type(dependencies).__name__}")
    out = []
    for node, deps in dependencies.items():
        if node not in nodes:
            raise VerlConfigError(f"dependencies names node '{node}', which is not in the dataflow"
                                  f"{nearest(node, nodes, 'nodes')}")
        if isinstance(deps, str):
            deps = [deps]
        if not isinstance(deps, Iterable):
            raise VerlConfigError(f"dependencies['{node}'] must be a list of node names, got {deps!r}")
        for d in deps:
            if d not in nodes:
                raise VerlConfigError(f"dependencies['{node}'] names '{d}', which is not in the dataflow"
                                      f"{nearest(d, nodes, 'nodes')}")
            if d == node:
                raise VerlConfigError(f"dependencies['{node}'] lists '{node}' itself (a cycle {node} -> {node}); "
                                      f"remove it")
            out.append((d, node))
    return out


def _topological_order(df: Dataflow) -> tuple[str, ...]:
    succ: dict[str, list[str]] = {n: [] for n in df._entries}
    indeg = {n: 0 for n in df._entries}
    for u, v in df._edges:
        succ[u].append(v)
        indeg[v] += 1
    heap = [(df._index[n], n) for n, d in indeg.items() if d == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, n = heapq.heappop(heap)
        order.append(n)
        for v in succ[n]:
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(heap, (df._index[v], v))
    if len(order) != len(df._entries):
        raise VerlConfigError(_describe_cycle(df, {n for n, d in indeg.items() if d > 0}))
    return tuple(order)


def _describe_cycle(df: Dataflow, stuck: set[str]) -> str:
    # Every node left over by Kahn's algorithm has a left-over predecessor, so walking predecessors from any
    # of them must revisit one: that loop is a cycle.
    pred = {v: u for u, v in df._edges if u in stuck and v in stuck}
    node = min(stuck, key=df._index.__getitem__)
    path, seen = [node], {node: 0}
    while pred[node] not in seen:
        node = pred[node]
        seen[node] = len(path)
        path.append(node)
    cycle = list(reversed(path[seen[pred[node]]:]))
    first = min(range(len(cycle)), key=lambda i: df._index[cycle[i]])  # start at the earliest-given node
    cycle = cycle[first:] + cycle[:first]
    cycle.append(cycle[0])
    steps = " -> ".join(f"{a} -[{df._edges[(a, b)]}]" for a, b in zip(cycle, cycle[1:]))
    keyed = [(b, df._edges[(a, b)][5:-1]) for a, b in zip(cycle, cycle[1:]) if df._edges[(a, b)].startswith("key '")]
    lag = (f", or break it with a lag: let one node read its key from the previous run (e.g. configs['{keyed[0][0]}']"
           f" = dict(lag={{'{keyed[0][1]}': 1}}))") if keyed else ""
    return (f"the dataflow has a cycle: {steps} -> {cycle[-1]}; remove one of these dependencies or rename a key "
            f"so that one of these nodes no longer waits for the next{lag}")


def _check_lags(df: Dataflow) -> None:
    for e in df._entries.values():
        for what, entries in (("lag", e.config.lag), ("queue", e.config.queue)):
            for key, k in entries.items():
                if key not in e.node.input_keys:
                    raise VerlConfigError(f"node '{e.name}': {what} names key '{key}', which is not one of its "
                                          f"inputs {list(e.node.input_keys)}"
                                          f"{nearest(key, e.node.input_keys, 'inputs')}")
                if df._bindings[e.name][key] is None:
                    raise VerlConfigError(f"node '{e.name}' reads '{key}' with {what} {k}, but no node produces "
                                          f"'{key}' (it is a run input, given afresh every run); drop the {what}, "
                                          f"or add the node that produces it")


def _stages(df: Dataflow) -> tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]:
    """Connected components of the graph without its queued inputs. Each must run on ranks of its own: a rank
    in two stages would have to run both at once."""
    queued = df.queued
    if not queued:
        return ((df._order, ()),)
    if any(e.config.lag for e in df._entries.values()):
        raise VerlConfigError("a dataflow reads inputs both through queues and with lags; queues already let the "
                              "producer run ahead: read the key through a queue only")
    parent = {n: n for n in df._entries}

    def root(n):
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n
    for u, v in df._edges:  # every input read this run, and every dependency
        parent[root(u)] = root(v)
    groups: dict[str, list[str]] = {}
    for n in df._order:
        groups.setdefault(root(n), []).append(n)
    out = []
    for nodes in groups.values():
        unplaced = [n for n in nodes if df._entries[n].config.device_map is None]
        if unplaced:
            raise VerlConfigError(f"node '{unplaced[0]}' has no device_map, but the dataflow has queues {_queues(df)}; "
                                  f"every node of a dataflow with queues needs a device_map, because each stage "
                                  f"runs on ranks of its own")
        out.append((tuple(nodes), tuple(sorted({r for n in nodes for r in df._entries[n].config.device_map}))))
    for i, (a_nodes, a) in enumerate(out):
        for b_nodes, b in out[i + 1:]:
            shared = sorted(set(a) & set(b))
            if shared:
                raise VerlConfigError(f"ranks {shared} run nodes of two stages joined by the queues {_queues(df)}: "
                                      f"{list(a_nodes)} on {list(a)} and {list(b_nodes)} on {list(b)}; a queue "
                                      f"lets both stages run at once, so give them disjoint device maps (or read "
                                      f"the key with a lag instead)")
    if len(out) == 1:
        raise VerlConfigError(f"the queues {_queues(df)} do not split the dataflow: their producers and consumers "
                              f"are also joined by ordinary inputs or dependencies; read the key with a lag instead")
    return tuple(out)


def _queues(df: Dataflow) -> list[str]:
    return [f"{p} -[{k}]-> {c}" for p, k, c, _ in df.queued]


def _check_placement(df: Dataflow) -> None:
    ws = df._world_size
    for e in df._entries.values():
        dm = e.config.device_map
        if dm is not None and dm[-1] >= ws:
            bad = [r for r in dm if r >= ws]
            raise VerlConfigError(
                f"node '{e.name}': device_map names rank(s) {bad} but the world has {ws} rank(s) (0..{ws - 1}); "
                f"use ranks below {ws}, or launch more processes (torchrun --nproc_per_node={dm[-1] + 1})")


# ------------------------------------------------------------------------------------------------------------
def _ancestors(df: Dataflow, name: str) -> set[str]:
    pred: dict[str, set[str]] = {}
    for u, v in df._edges:
        pred.setdefault(v, set()).add(u)
    return reachable(pred, name)


def _descendants(df: Dataflow, name: str) -> set[str]:
    succ: dict[str, set[str]] = {}
    for u, v in df._edges:
        succ.setdefault(u, set()).add(v)
    return reachable(succ, name)


def inject_node(base_dataflow: Dataflow | Mapping[str, Any], node: Node, after: str, before: str, *,
                name: str | None = None, config: Mapping[str, Any] | NodeConfig | None = None) -> Dataflow:
    """A new dataflow in which ``node`` runs after ``after`` and before ``before``; the base is unchanged.

    The node reads its inputs from upstream outputs (the versions ``before`` would have read). Its outputs
    replace the same-named keys for ``before`` and every node downstream of it, and new keys are added.
    ``name`` defaults to the function's name; ``config`` is its NodeConfig / settings overrides (by default it
    runs where ``before`` runs, with the same engine).
    """
    base = Dataflow.from_dict(base_dataflow)
    node = as_node(node, "inject_node(node=...)")
    name = name or node.name
    _check_injection_point(base, name, after, before)
    if config is None:
        bcfg = base.config(before)
        config = NodeConfig(device_map=bcfg.device_map, device_types=bcfg.device_types, engine=bcfg.engine)
    entry = NodeEntry(name, node, make_config(name, config, node.settings))

    upstream = _ancestors(base, after) | {after}
    downstream = _descendants(base, before) | {before}
    producers: dict[str, list[str]] = {}
    for e in base._entries.values():
        for k in e.node.output_keys:
            producers.setdefault(k, []).append(e.name)
    # Reading side: the node's inputs, bound to what `before` would have read.
    bindings = {n: dict(b) for n, b in base._bindings.items()}
    bindings[name] = {k: _visible_producer(base, k, before, upstream, producers, name) for k in node.input_keys}
    edges = dict(base._edges)
    edges[(after, name)] = "inject_node(after=...)"
    edges[(name, before)] = "inject_node(before=...)"
    for k, p in bindings[name].items():
        if p is not None and k not in entry.config.lag:
            edges.setdefault((p, name), f"key '{k}'")
    # Writing side: each output replaces the upstream version of its key for everything downstream.
    exports = dict(base._exports)
    for k in node.output_keys:
        _check_unambiguous_output(name, k, producers.get(k, []), upstream, downstream, after, before)
        for d in downstream:
            b = bindings[d]
            if k in b and (b[k] is None or b[k] in upstream):
                b[k] = name
                if k not in base.config(d).lag:
                    edges.setdefault((name, d), f"key '{k}'")
        if exports.get(k) is None or exports[k] in upstream:
            exports[k] = name
    return Dataflow(base.entries + (entry,), bindings, edges, exports, base.world_size, base._inputs)


def _check_injection_point(base: Dataflow, name: str, after: str, before: str) -> None:
    for role, n in (("after", after), ("before", before)):
        if n not in base:
            raise VerlConfigError(f"inject_node: {role}='{n}' is not a node of the dataflow"
                                  f"{nearest(n, base.names, 'nodes')}")
    if name in base:
        raise VerlConfigError(f"inject_node: the dataflow already has a node named '{name}'; pass name='...'")
    if after == before:
        raise VerlConfigError(f"inject_node: after and before are both '{after}'; the node must run between two "
                              f"different nodes")
    below_after = _descendants(base, after)
    if before not in below_after:
        raise VerlConfigError(
            f"inject_node: '{before}' does not run after '{after}' (no dependency path {after} -> ... -> {before}), "
            f"so nothing can run between them; pick before= among the nodes downstream of '{after}': "
            f"{sorted(below_after, key=base._index.__getitem__) or 'none'}")


def _check_unambiguous_output(name: str, key: str, producers: Sequence[str], upstream: set[str],
                              downstream: set[str], after: str, before: str) -> None:
    """A producer of ``key`` beside the injection point (neither up- nor downstream) would leave the nodes
    below it two candidate versions of ``key``."""
    others = [p for p in producers if p not in upstream and p not in downstream]
    if others:
        raise VerlConfigError(
            f"inject_node: '{name}' outputs '{key}', which '{others[0]}' also produces, and '{others[0]}' runs "
            f"neither before '{after}' nor after '{before}', so which '{key}' a node reads would be ambiguous; "
            f"rename the output or inject after '{others[0]}'")


def _visible_producer(base: Dataflow, key: str, before: str, upstream: set[str],
                      producers: Mapping[str, list[str]], name: str) -> str | None:
    """Which node's ``key`` an injected node reads: the one ``before`` reads, else the latest upstream one."""
    bound = base._bindings[before].get(key, "<unbound>")
    if bound != "<unbound>" and (bound is None or bound in upstream):
        return bound
    cands = [p for p in producers.get(key, []) if p in upstream]
    if not cands:
        later = producers.get(key, [])
        if later:
            raise VerlConfigError(f"inject_node: '{name}' reads '{key}', which only '{later[0]}' produces, and "
                                  f"'{later[0]}' does not run before the injection point; inject it after "
                                  f"'{later[0]}'")
        return None
    # Producers of one key upstream form a chain (each injection replaces the previous); take its last link.
    for c in cands:
        if all(o == c or o in _ancestors(base, c) for o in cands):
            return c
    raise VerlConfigError(f"inject_node: '{name}' reads '{key}', produced upstream by {cands} with no order "
                          f"between them; add a dependency between them first")
