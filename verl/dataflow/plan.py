"""The plan of a dataflow on one rank: which nodes it runs, where each value lives, what moves between ranks.

A plan is compiled once per dataflow and process (`plan_for`, cached weakly by the dataflow, which stays a
read-only description): every node input becomes an index (a slot) into a flat value list, so a colocated run is
a loop of ``fn(**{param: values[i]})`` calls plus an output check. Under torch.distributed every rank compiles
the same plan and walks it in the same order: a rank outside a node's device map skips the node but still takes
part in moving that node's inputs and outputs (`Transfer`), which is what keeps the ranks' point-to-point calls
and collectives matched.

Runs that depend on earlier runs: an input a node's config reads with ``lag=k`` gets a slot of its own, filled
before the run from the caller's `RunState` (`verl.dataflow.state`) on the producer's ranks and moved to the
reader's ranks before the first node (`Plan.carry_transfers`), so a rollout's ranks start generating the next
batch at once.

Stages: a dataflow with queued inputs (``queue={key: size}``, `verl.dataflow.queue`) is split into stages, and a
rank's plan holds only its own stage's agreements: queued values are read from their channel before the first
node (`Plan.queues_in`), the values a stage makes for a queue are put after the run (`Plan.queues_out`).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from verl.dataflow import comm
from verl.dataflow.node import NodeContext, NodeEntry
from verl.errors import VerlConfigError

__all__ = ["Carried", "FlowGraph", "MISSING", "Plan", "Step", "Transfer", "plan_for", "reachable"]

MISSING = object()
"""The value of a slot nothing has filled (a node that was skipped, failed or runs elsewhere)."""
_LOCAL_KEY = ("local",)


class FlowGraph(Protocol):
    """What a plan reads of a dataflow: `verl.dataflow.graph.Dataflow`'s public side. Named here rather than
    imported, because graph.py imports the runtime to run a dataflow."""

    @property
    def order(self) -> tuple[str, ...]: ...
    @property
    def entries(self) -> tuple[NodeEntry, ...]: ...
    def entry(self, name: str) -> NodeEntry: ...
    def producer(self, consumer: str, key: str) -> str | None: ...
    def lag(self, consumer: str, key: str) -> int: ...
    @property
    def carried(self) -> dict[tuple[str, str], int]: ...
    @property
    def edges(self) -> list[tuple[str, str]]: ...
    @property
    def exports(self) -> Mapping[str, str]: ...
    @property
    def world_size(self) -> int: ...
    @property
    def stages(self) -> list[tuple[tuple[str, ...], tuple[int, ...]]]: ...
    @property
    def queued(self) -> list[tuple[str, str, str, int]]: ...
    def check_inputs(self, available: Iterable[str], only: Iterable[str] | None = None) -> None: ...


@dataclass(slots=True)
class Transfer:
    """Move value ``src_slot`` (held by ``src_ranks``) into ``dst_slot`` laid out over ``dst_ranks``."""

    src_slot: int
    dst_slot: int
    key: str
    producer: str
    src_ranks: tuple[int, ...]
    dst_ranks: tuple[int, ...]
    replicated: bool
    control: Any = None

    @property
    def ranks(self) -> list[int]:
        """Every rank that takes part: the producer's and the consumer's."""
        return sorted(set(self.src_ranks) | set(self.dst_ranks))


@dataclass(slots=True)
class Step:
    """One node of the plan: its call on this rank (when `runs_here`) and the transfers feeding it."""

    entry: NodeEntry
    fn: Any
    arg_names: tuple[str, ...] | None
    arg_slots: tuple[int, ...]
    out_slots: tuple[int, ...]
    ctx: NodeContext
    runs_here: bool
    group_size: int
    control: Any = None
    transfers: list[Transfer] = field(default_factory=list)
    lagged: tuple[tuple[str, str, int], ...] = ()
    """(producer, key, runs back) of each lagged input: the step is skipped while the state lacks one."""
    below: frozenset[str] = frozenset()
    """Nodes that wait for this one within a run (skipped with it)."""


@dataclass(slots=True)
class Carried:
    """A (producer, key) some node reads from earlier runs: where this run's value lands, and the slots the
    earlier runs' values are put in (by runs back) before the run starts."""

    producer: str
    key: str
    slot: int
    lag_slots: dict[int, int]
    reads: dict[int, int] = field(default_factory=dict)
    """runs back -> the slot this rank's consumers read (their copy, after the carried transfer)."""


@dataclass(slots=True)
class Plan:
    steps: list[Step]
    external: dict[str, int]
    exports: dict[str, tuple[int, ...]]
    nslots: int
    rank: int
    world_size: int
    distributed: bool
    control: Any = None
    carried: list[Carried] = field(default_factory=list)
    carry_transfers: list[Transfer] = field(default_factory=list)
    """Transfers of earlier runs' values, done before the first node: the values exist when the run starts, so
    their producers' ranks are free at once for this run's work (a rollout generating the next batch)."""
    members: tuple[int, ...] = ()
    """The ranks that run with this one: its stage's (a dataflow with queues), else every rank."""
    queues_in: list[tuple[Any, int]] = field(default_factory=list)
    """(channel, slot) of each queued input this rank's nodes read: filled from the channel before the run."""
    queues_out: list[tuple[Any, int]] = field(default_factory=list)
    """(channel, slot) of each value this rank produces for a queue: put into the channel after the run."""


def device_for(entry: NodeEntry, rank: int) -> torch.device:
    """The device `rank` runs `entry` on: its device map's entry ('cuda' / 'cpu'), else cuda when available."""
    kind = ""
    cfg = entry.config
    if cfg.device_map is not None and rank in cfg.device_map:
        kind = cfg.device_types[cfg.device_map.index(rank)]
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda" or (kind == "" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


class _Compiler:
    """Builds one rank's `Plan`: slot numbering, the views (copies of a value laid out over a consumer's ranks),
    and the groups, which are created collectively, so every rank makes the same ones in the same plan order."""

    def __init__(self, df: FlowGraph, rank: int, world: int, distributed: bool):
        self.df, self.rank, self.world, self.distributed = df, rank, world, distributed
        self.all_ranks = tuple(range(world))
        self.slots: dict[tuple[str | None, str], int] = {}
        self.views: dict[tuple[int, tuple[int, ...]], int] = {}
        self.lag_slots: dict[tuple[str, str, int], int] = {}  # earlier runs' values, held where their producer runs
        self.layout: dict[int, tuple[int, ...] | None] = {}  # slot -> ranks holding it (None: every rank, as inputs)
        self.carry_transfers: list[Transfer] = []
        self.reads: dict[tuple[str, str, int], int] = {}
        self.channels: dict[tuple[str, str, tuple[int, ...]], Any] = {}
        self.queues_in: list[tuple[Any, int]] = []
        self.queued = {(c, k): (p, size) for p, k, c, size in df.queued}
        self.succ: dict[str, set[str]] = {}
        for u, v in df.edges:
            self.succ.setdefault(u, set()).add(v)

    def fresh(self) -> int:
        return len(self.slots) + len(self.views) + len(self.lag_slots)

    def slot(self, producer: str | None, key: str) -> int:
        if (producer, key) not in self.slots:
            self.slots[(producer, key)] = self.fresh()
        return self.slots[(producer, key)]

    def lag_slot(self, producer: str, key: str, k: int) -> int:
        if (producer, key, k) not in self.lag_slots:
            self.lag_slots[(producer, key, k)] = self.fresh()
            self.layout[self.lag_slots[(producer, key, k)]] = self.df.entry(producer).config.device_map or \
                self.all_ranks
        return self.lag_slots[(producer, key, k)]

    def controls(self) -> tuple[Any, tuple[int, ...]]:
        """(this rank's status group, the ranks it runs with): its stage's when queues split the flow."""
        stages = self.df.stages
        if len(stages) > 1:  # each stage runs on its own: its agreements and status exchange stay among its ranks
            controls = [comm.control_group(ranks) for _, ranks in stages]
            mine = [i for i, (_, ranks) in enumerate(stages) if self.rank in ranks]
            return (controls[mine[0]], stages[mine[0]][1]) if mine else (None, ())
        return (comm.control_group(self.all_ranks) if self.distributed else None), self.all_ranks

    def input_slot(self, name: str, key: str, ranks: tuple[int, ...], transfers: list[Transfer],
                   lagged: list) -> int:
        """The slot node `name` reads `key` from on its `ranks`: the producer's, a view of it moved there, a
        lagged value's, or a queue's."""
        df = self.df
        producer = df.producer(name, key)
        if (name, key) in self.queued:
            return self.queue_slot(self.slot(producer, key), key, ranks, self.queued[(name, key)][1], producer)
        k = df.lag(name, key) if producer is not None else 0
        s = self.lag_slot(producer, key, k) if k else self.slot(producer, key)
        if producer is not None and self.layout[s] != ranks:
            vkey = (s, ranks)
            if vkey not in self.views:
                self.views[vkey] = self.fresh()
                union = tuple(sorted(set(self.layout[s]) | set(ranks)))
                pcfg = df.entry(producer).config
                (self.carry_transfers if k else transfers).append(
                    Transfer(s, self.views[vkey], key, producer, self.layout[s], ranks,
                             key in pcfg.replicated_outputs, comm.control_group(union) if self.distributed else None))
            s = self.views[vkey]
        if k:
            lagged.append((producer, key, k))
            if self.rank in ranks:
                self.reads[(producer, key, k)] = s
        return s

    def step(self, name: str) -> Step:
        entry = self.df.entry(name)
        ranks = entry.config.device_map or self.all_ranks
        group = comm.group_for(ranks) if self.distributed else None
        control = comm.control_group(ranks) if self.distributed else None
        ctx = NodeContext(name=name, rank=self.rank, world_size=self.world, ranks=ranks,
                          device=device_for(entry, self.rank), engine=entry.config.engine, config=entry.config,
                          settings=entry.config.settings, process_group=group)
        transfers: list[Transfer] = []
        lagged: list[tuple[str, str, int]] = []
        arg_slots = [self.input_slot(name, key, ranks, transfers, lagged) for key in entry.node.input_keys]
        outs = []
        for key in entry.node.output_keys:
            s = self.slot(name, key)
            self.layout[s] = ranks
            outs.append(s)
        node = entry.node
        return Step(entry=entry, fn=node.fn, arg_names=node.input_keys if node.by_keyword else None,
                    arg_slots=tuple(arg_slots), out_slots=tuple(outs), ctx=ctx, runs_here=self.rank in ranks,
                    group_size=len(ranks), control=control, transfers=transfers, lagged=tuple(lagged),
                    below=frozenset(reachable(self.succ, name)))

    def queue_slot(self, src_slot: int, key: str, ranks: tuple[int, ...], size: int, producer: str) -> int:
        """The slot a queued input lands in on the consumer's ranks: a view of the producer's slot, as a
        transfer's would be (one channel per producer, key and consumer rank set; creating its group is
        collective, so every rank makes it in plan order)."""
        from verl.dataflow.queue import QueueChannel
        from verl.distributed.placement import new_group
        ck = (producer, key, ranks)
        if ck not in self.channels:
            src = self.df.entry(producer).config.device_map
            union = sorted(set(src) | set(ranks))
            group = new_group(union, backend="gloo") if self.distributed else None
            replicated = key in self.df.entry(producer).config.replicated_outputs
            self.channels[ck] = QueueChannel(producer, key, src, ranks, size, replicated, group,
                                             comm.control_group(src) if self.distributed else None)
            self.views[(src_slot, ranks)] = self.fresh()
            self.queues_in.append((self.channels[ck], self.views[(src_slot, ranks)]))
        return self.views[(src_slot, ranks)]

    def plan(self) -> Plan:
        world_control, members = self.controls()
        steps = [self.step(name) for name in self.df.order]
        # A rank needs only the inputs of the nodes it runs (in split placement the scorer's ranks never see
        # the prompts).
        needed = {s for st in steps if st.runs_here for s in st.arg_slots}
        external = {k: s for (p, k), s in self.slots.items() if p is None and s in needed}
        # What a rank returns of each output: the value itself where it was produced, else the copy the rank
        # received for one of its nodes (a split-placement actor rank holds the scores computed on reward ranks).
        exports = {k: (self.slots[(p, k)],) + tuple(v for (s, _), v in self.views.items() if s == self.slots[(p, k)])
                   for k, p in self.df.exports.items()}
        carried = [Carried(p, key, self.slots[(p, key)],
                           {k: s for (pp, kk, k), s in self.lag_slots.items() if (pp, kk) == (p, key)},
                           {k: s for (pp, kk, k), s in self.reads.items() if (pp, kk) == (p, key)})
                   for p, key in self.df.carried]
        queues_out = [(ch, self.slots[(ch.producer, ch.key)]) for ch in self.channels.values() if self.rank in ch.src]
        return Plan(steps, external, exports, self.fresh(), self.rank, self.world, self.distributed, world_control,
                    carried, self.carry_transfers, members, [q for q in self.queues_in if self.rank in q[0].dst],
                    queues_out)


def reachable(succ: Mapping[str, set[str]], name: str) -> set[str]:
    """Every node reachable from `name` along `succ` (`name` itself only through a cycle)."""
    out, stack = set(), [name]
    while stack:
        for v in succ.get(stack.pop(), ()):
            if v not in out:
                out.add(v)
                stack.append(v)
    return out


# Plans per dataflow, then per (rank, world size, world group): a dataflow object can be run by a local
# process and later under a new process group, and a plan holds that group's communicators.
PLANS: weakref.WeakKeyDictionary[FlowGraph, dict[tuple, Plan]] = weakref.WeakKeyDictionary()


def plan_for(df: FlowGraph) -> Plan:
    """This rank's plan of `df` (compiled on first use, collectively under torch.distributed)."""
    plans = PLANS.get(df)
    if plans is None:
        plans = PLANS[df] = {}
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not distributed:
        plan = plans.get(_LOCAL_KEY)
        if plan is not None:
            return plan
        if df.world_size > 1:
            raise VerlConfigError(f"the dataflow was built for {df.world_size} ranks but torch.distributed is not "
                                  f"initialised; launch with torchrun and call init_process_group first")
        plan = plans[_LOCAL_KEY] = _Compiler(df, 0, 1, False).plan()
        return plan
    rank, world = dist.get_rank(), dist.get_world_size()
    key = (rank, world, id(dist.group.WORLD))
    plan = plans.get(key)
    if plan is None:
        bad = [e.name for e in df.entries if e.config.device_map is not None and e.config.device_map[-1] >= world]
        if bad:
            raise VerlConfigError(f"the dataflow was built for {df.world_size} ranks but runs on {world}; the "
                                  f"device_map of {bad} names ranks that do not exist here")
        plan = plans[key] = _Compiler(df, rank, world, True).plan()
    return plan
