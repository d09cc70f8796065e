"""Running a dataflow on one rank: the compiled plan, the node call, redistribution and error agreement.

A plan is compiled once per dataflow and process (and cached here, keyed weakly by the dataflow, which stays
a read-only description): every node input becomes an index into a flat value list, so a colocated run is a
loop of ``fn(**{param: values[i]})`` calls plus an output check. Under
torch.distributed every rank walks the same plan in the same order: a rank outside a node's device map skips
the node but still takes part in moving that node's inputs and outputs, which is what keeps the ranks'
point-to-point calls and collectives matched.

Runs that depend on earlier runs: an input a node's config reads with ``lag=k`` gets a slot of its own,
filled before the run from the caller's `RunState` on the producer's ranks and moved to the reader's ranks
before the first node (so a rollout's ranks start generating the next batch at once). Which nodes a run skips
for want of such a value depends only on how many runs the state has seen, so every rank skips the same ones;
after a successful run each producer's new value is appended to the state.

Stages: a dataflow with queued inputs (``queue={key: size}``, `verl.dataflow.queue`) is split into stages, and a
rank walks only its own stage's plan: the queued values are taken from their channel before the first node,
the values a stage makes for a queue are put after the status exchange (the run's failure in their place), and
agreements and the status exchange stay among the stage's ranks, so the stages never wait for each other's runs.

Errors: a node failing on a rank becomes VerlRuntimeError(node, rank, cause chained). That rank stops running
nodes but keeps walking the plan, sending error markers where data was expected; before each multi-rank node
its ranks agree (a one-int all-reduce on a gloo control group, so a NCCL job's GPU streams are never
synchronised for it) that nobody has failed; at the end of the run all ranks exchange their
status, so every rank raises the same VerlRuntimeError instead of waiting for data that will never come.
`sys.exit()` inside a node (SystemExit) takes this path too and becomes VerlRuntimeError on every rank. A
KeyboardInterrupt (Ctrl-C, SIGINT) inside a node is the one exception: it leaves the run at once on the
interrupted rank, because the agreement would wait for peers that may be busy inside their nodes for minutes,
and a rank waiting in a gloo or NCCL collective cannot be interrupted a second time. Its peers learn of it
when their next collective with it fails (the connection closes as the process exits; under torchrun the agent
also stops them) and raise VerlRuntimeError saying so.

Timeouts. Guarantees:
- Every node has a time limit (``timeout_s``: an hour unless its config says otherwise, 0 only on request,
  `verl.dataflow.config.DEFAULT_NODE_TIMEOUT_S`). A node still running after that long (on one rank; retries, onload and offload
  included) is interrupted and the run fails on every rank with VerlRuntimeError naming the node, the rank, the
  limit and the elapsed time. In the main thread the interrupt is SIGALRM (an interval timer, restored after
  the node), whose handler raises inside the node: it stops pure-Python loops at their next bytecode and wakes
  the blocking calls Python retries after a signal (sleep, lock and queue waits, socket reads, subprocess
  waits). The timer re-fires every second, so a node that swallows the interrupt (``except BaseException``)
  is interrupted again. In another thread the interrupt is an asynchronous exception set on that thread,
  delivered at its next bytecode.
- Every process group has the job's collective timeout (`verl.distributed.collective_timeout`,
  ``trainer.collective_timeout_s``). A rank whose peer died or hangs outside the agreement points leaves its
  collective after at most that long; a collective of the runtime itself (an agreement, a transfer, the final
  status exchange) that fails or times out raises VerlRuntimeError at once, naming the ranks it waited for,
  what it was doing and this rank's own failure if it had one.
Limits:
- Python cannot unwind a thread blocked inside native code: a node stuck in a collective, a CUDA
  synchronisation or a C extension is interrupted only when that call returns; collectives return at the
  latest after the collective timeout, an endless native call never. Peers then still end: they wait for such a
  rank at most one collective timeout at their next agreement point.
- A failure reaches the other ranks at their next agreement point, i.e. after their current node returns:
  with node timeouts set, a run ends at most one node timeout plus one collective timeout after a failure.
- SIGALRM belongs to the runtime while a timed node runs in the main thread; a node that arms its own
  ITIMER_REAL runs without the timer (the thread path is used instead).
"""

from __future__ import annotations

import ctypes
import difflib
import os
import signal
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from verl.dataflow import comm
from verl.dataflow.node import NodeContext, NodeEntry, TransientError
from verl.dataflow.trace import NodeEvent, TraceRecorder, write_trace
from verl.errors import VerlConfigError, VerlRuntimeError

_MISSING = object()
_NO_FAILURE = 1 << 30
_LOCAL_KEY = ("local",)


class Dataflow(Protocol):
    """What the runtime reads of a dataflow: `verl.dataflow.graph.Dataflow`'s public side. Named here rather
    than imported, because graph.py imports this module to run a dataflow."""

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
    def check_inputs(self, available: Iterable[str], only: Iterable[str] | None = None) -> None: ...


@dataclass(slots=True)
class _Transfer:
    """Move value ``src_slot`` (held by ``src_ranks``) into ``dst_slot`` laid out over ``dst_ranks``."""

    src_slot: int
    dst_slot: int
    key: str
    producer: str
    src_ranks: tuple[int, ...]
    dst_ranks: tuple[int, ...]
    replicated: bool
    control: Any = None


@dataclass(slots=True)
class _Step:
    entry: NodeEntry
    fn: Any
    arg_names: tuple[str, ...] | None
    arg_slots: tuple[int, ...]
    out_slots: tuple[int, ...]
    ctx: NodeContext
    runs_here: bool
    group_size: int
    control: Any = None
    transfers: list[_Transfer] = field(default_factory=list)
    lagged: tuple[tuple[str, str, int], ...] = ()
    """(producer, key, runs back) of each lagged input: the step is skipped while the state lacks one."""
    below: frozenset[str] = frozenset()
    """Nodes that wait for this one within a run (skipped with it)."""


@dataclass(slots=True)
class _Carried:
    """A (producer, key) some node reads from earlier runs: where this run's value lands, and the slots the
    earlier runs' values are put in (by runs back) before the run starts."""

    producer: str
    key: str
    slot: int
    lag_slots: dict[int, int]
    reads: dict[int, int] = field(default_factory=dict)
    """runs back -> the slot this rank's consumers read (their copy, after the carried transfer)."""


@dataclass(slots=True)
class _Plan:
    steps: list[_Step]
    external: dict[str, int]
    exports: dict[str, tuple[int, ...]]
    nslots: int
    rank: int
    world_size: int
    distributed: bool
    control: Any = None
    carried: list[_Carried] = field(default_factory=list)
    carry_transfers: list[_Transfer] = field(default_factory=list)
    """Transfers of earlier runs' values, done before the first node: the values exist when the run starts, so
    their producers' ranks are free at once for this run's work (a rollout generating the next batch)."""
    members: tuple[int, ...] = ()
    """The ranks that run with this one: its stage's (a dataflow with queues), else every rank."""
    queues_in: list[tuple[Any, int]] = field(default_factory=list)
    """(channel, slot) of each queued input this rank's nodes read: filled from the channel before the run."""
    queues_out: list[tuple[Any, int]] = field(default_factory=list)
    """(channel, slot) of each value this rank produces for a queue: put into the channel after the run."""


class RunState:
    """The values a dataflow's lagged inputs carry from one run to the next; the caller keeps it between runs
    (the dataflow stays a read-only description). Each rank's state holds what its ranks produced.

    Lag ``k`` reads the ``k``-th newest value the producer made; a run in which the producer was skipped adds
    none (a skipped learner keeps its weights). The first runs are the prologue: while the state holds fewer
    than ``k`` values of a key read with lag ``k``, the reading node and every node that waits for it within
    the run are skipped (their outputs are absent from the result), so with ``generate -> batch -(lag 1)->
    train`` run 0 only generates and run 1 trains on run 0's batch while generating the next.
    ``initial={key: value}`` (or `push`) seeds the state instead, as if the key's producer had made ``value``
    in a run before the first.
    """

    __slots__ = ("_dataflow", "_depth", "_history", "_read", "runs")

    def __init__(self, dataflow: Dataflow, initial: Mapping[str, Any] | None = None):
        from collections import deque
        self._dataflow = dataflow
        self._depth = dict(dataflow.carried)
        self._history: dict[tuple[str, str], Any] = {pk: deque(maxlen=k) for pk, k in self._depth.items()}
        self._read: dict[tuple[str, int], Any] = {}
        self.runs = 0
        """Runs completed with this state."""
        for key, value in (initial or {}).items():
            self.push(key, value)

    def _carried_key(self, key: str) -> tuple[str, str]:
        found = [pk for pk in self._history if pk[1] == key]
        if not found:
            from verl.errors import nearest
            raise VerlConfigError(f"no node reads '{key}' with a lag, so there is nothing to carry for it"
                                  f"{nearest(key, [k for _, k in self._history], 'lagged keys')}")
        if len(found) > 1:
            raise VerlConfigError(f"'{key}' is read with a lag from several producers {[p for p, _ in found]}; "
                                  f"seed the state by running the prologue instead")
        return found[0]

    def push(self, key: str, value: Any) -> None:
        """Records ``value`` as the newest run's value of ``key`` (seeding the prologue away)."""
        self._history[self._carried_key(key)].append(value)

    def available(self, producer: str, key: str, lag: int) -> bool:
        return len(self._history[(producer, key)]) >= lag

    def value(self, producer: str, key: str, lag: int) -> Any:
        return self._history[(producer, key)][-lag]

    def lagged(self, key: str, lag: int = 1, default: Any = None) -> Any:
        """The value of ``key`` from ``lag`` runs back that this rank's nodes read in the last run (a trainer's
        metrics read the batch it trained on this way), else ``default``."""
        return self._read.get((key, lag), default)

    def state_dict(self) -> dict[str, Any]:
        """This rank's carried values: ``{"runs": n, "carried": {"producer/key": [value, ...]}}`` (oldest first,
        as the nodes made them; None where this rank holds none)."""
        return {"runs": self.runs, "carried": {f"{p}/{k}": [None if v is _MISSING else v for v in h]
                                               for (p, k), h in self._history.items()}}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restores what `state_dict` gave on this rank (a resumed job continues with the same carried values)."""
        names = {f"{p}/{k}": pk for pk in self._history for p, k in [pk]}
        if set(d["carried"]) != set(names):
            raise VerlConfigError(f"the saved run state carries {sorted(d['carried'])} but this dataflow carries "
                                  f"{sorted(names)}; resume with the dataflow (trainer.mode, max_staleness) it was "
                                  f"saved with")
        for name, entries in d["carried"].items():
            h = self._history[names[name]]
            if len(entries) > h.maxlen:
                raise VerlConfigError(f"the saved run state holds {len(entries)} values of '{name}' but this "
                                      f"dataflow reads it at most {h.maxlen} runs back; resume with the lags it was "
                                      f"saved with")
            h.clear()
            h.extend(entries)
        self.runs = int(d["runs"])

    def _finish(self, plan: _Plan, vals: list, skipped: set[str]) -> None:
        for c in plan.carried:
            if c.producer not in skipped:
                self._history[(c.producer, c.key)].append(vals[c.slot])
            for k, s in c.reads.items():
                v = vals[s]
                if v is _MISSING:
                    self._read.pop((c.key, k), None)
                else:
                    self._read[(c.key, k)] = v
        self.runs += 1


@dataclass(slots=True)
class _Failure:
    node: str
    rank: int
    message: str
    exc: BaseException | None = None
    also: str = ""


# ---- node timeouts -----------------------------------------------------------------------------------------
class NodeTimeout(BaseException):
    """Raised inside a node that ran past its ``timeout_s``. A BaseException, like KeyboardInterrupt, so that a
    node's own ``except Exception`` and the retry loop do not swallow it."""


class _Deadline:
    """Interrupts the code inside ``with`` after ``timeout_s`` seconds (see the module docstring)."""

    __slots__ = ("timeout_s", "start", "_old", "_timer", "_lock", "_done", "_tid")

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._old: Any = None
        self._timer: threading.Timer | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def __enter__(self) -> "_Deadline":
        self.start = time.monotonic()
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer") \
                and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0):
            self._old = signal.signal(signal.SIGALRM, self._on_alarm)
            signal.setitimer(signal.ITIMER_REAL, self.timeout_s, 1.0)
        else:
            self._lock, self._done, self._tid = threading.Lock(), False, threading.get_ident()
            self._timer = threading.Timer(self.timeout_s, self._interrupt_thread)
            self._timer.daemon = True
            self._timer.start()
        return self

    def _on_alarm(self, signum, frame) -> None:
        raise NodeTimeout(f"still running after {self.elapsed():.1f} s")

    def _interrupt_thread(self) -> None:
        with self._lock:
            if not self._done:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._tid), ctypes.py_object(NodeTimeout))

    def __exit__(self, *exc) -> None:
        if self._timer is None:
            signal.setitimer(signal.ITIMER_REAL, 0.0)
            signal.signal(signal.SIGALRM, self._old if self._old is not None else signal.SIG_DFL)
            return
        self._timer.cancel()
        with self._lock:
            self._done = True
            # An interrupt set just as the node returned has not been delivered yet: withdraw it.
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._tid), None)


def _describe(exc: BaseException, cfg: Any, elapsed: float) -> str:
    """The failure message of a node that raised ``exc`` after ``elapsed`` seconds."""
    if isinstance(exc, _OutputError):
        return str(exc)
    if isinstance(exc, NodeTimeout):
        return (f"exceeded its timeout_s={cfg.timeout_s:g} (stopped after {elapsed:.1f} s); raise the node's "
                f"timeout_s or find what it waits for")
    if isinstance(exc, KeyboardInterrupt):
        return f"interrupted (KeyboardInterrupt: Ctrl-C or SIGINT) after {elapsed:.1f} s"
    if isinstance(exc, SystemExit):
        return (f"called sys.exit({exc.code!r}) (SystemExit); a node must raise an exception, not exit the "
                f"process: the other ranks would wait for it")
    return f"{type(exc).__name__}: {exc}"


# ---- plan --------------------------------------------------------------------------------------------------
def _device_for(entry: NodeEntry, rank: int) -> torch.device:
    kind = ""
    cfg = entry.config
    if cfg.device_map is not None and rank in cfg.device_map:
        kind = cfg.device_types[cfg.device_map.index(rank)]
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda" or (kind == "" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _compile(df: Dataflow, rank: int, world: int, distributed: bool) -> _Plan:
    slots: dict[tuple[str | None, str], int] = {}
    views: dict[tuple[int, tuple[int, ...]], int] = {}
    lag_slots: dict[tuple[str, str, int], int] = {}  # earlier runs' values, held where their producer runs
    layout: dict[int, tuple[int, ...] | None] = {}  # slot -> ranks holding it (None: every rank, as inputs)
    all_ranks = tuple(range(world))
    carry_transfers: list[_Transfer] = []
    reads: dict[tuple[str, str, int], int] = {}

    def fresh() -> int:
        return len(slots) + len(views) + len(lag_slots)

    def slot(producer, key):
        if (producer, key) not in slots:
            slots[(producer, key)] = fresh()
        return slots[(producer, key)]

    def lag_slot(producer, key, k):
        if (producer, key, k) not in lag_slots:
            lag_slots[(producer, key, k)] = fresh()
            layout[lag_slots[(producer, key, k)]] = df.entry(producer).config.device_map or all_ranks
        return lag_slots[(producer, key, k)]

    succ: dict[str, set[str]] = {}
    for u, v in df.edges:
        succ.setdefault(u, set()).add(v)

    # Groups are created collectively, so every rank creates the same ones in the same (plan) order.
    stages = df.stages
    members = all_ranks
    if len(stages) > 1:  # each stage runs on its own: its agreements and status exchange stay among its ranks
        controls = [comm.control_group(ranks) for _, ranks in stages]
        mine = [i for i, (_, ranks) in enumerate(stages) if rank in ranks]
        world_control = controls[mine[0]] if mine else None
        members = stages[mine[0]][1] if mine else ()
    else:
        world_control = comm.control_group(all_ranks) if distributed else None
    queued = {(c, k): (p, size) for p, k, c, size in df.queued}
    channels: dict[tuple[str, str, tuple[int, ...]], Any] = {}
    queues_in: list[tuple[Any, int]] = []
    steps = []
    for name in df.order:
        entry = df.entry(name)
        ranks = entry.config.device_map or all_ranks
        group = comm.group_for(ranks) if distributed else None
        control = comm.control_group(ranks) if distributed else None
        ctx = NodeContext(name=name, rank=rank, world_size=world, ranks=ranks, device=_device_for(entry, rank),
                          engine=entry.config.engine, config=entry.config, settings=entry.config.settings,
                          process_group=group)
        arg_slots, transfers, lagged = [], [], []
        for key in entry.node.input_keys:
            producer = df.producer(name, key)
            if (name, key) in queued:
                arg_slots.append(_queue_slot(df, channels, queues_in, slot(producer, key), key, ranks,
                                             queued[(name, key)][1], distributed, fresh, views, producer))
                continue
            k = df.lag(name, key) if producer is not None else 0
            s = lag_slot(producer, key, k) if k else slot(producer, key)
            if producer is not None and layout[s] != ranks:
                vkey = (s, ranks)
                if vkey not in views:
                    views[vkey] = fresh()
                    union = tuple(sorted(set(layout[s]) | set(ranks)))
                    pcfg = df.entry(producer).config
                    (carry_transfers if k else transfers).append(
                        _Transfer(s, views[vkey], key, producer, layout[s], ranks, key in pcfg.replicated_outputs,
                                  comm.control_group(union) if distributed else None))
                s = views[vkey]
            if k:
                lagged.append((producer, key, k))
                if rank in ranks:
                    reads[(producer, key, k)] = s
            arg_slots.append(s)
        outs = []
        for key in entry.node.output_keys:
            s = slot(name, key)
            layout[s] = ranks
            outs.append(s)
        node = entry.node
        steps.append(_Step(entry=entry, fn=node.fn, arg_names=node.input_keys if node.by_keyword else None,
                           arg_slots=tuple(arg_slots), out_slots=tuple(outs), ctx=ctx, runs_here=rank in ranks,
                           group_size=len(ranks), control=control, transfers=transfers, lagged=tuple(lagged),
                           below=frozenset(reachable(succ, name))))
    # A rank needs only the inputs of the nodes it runs (in split placement the scorer's ranks never see
    # the prompts).
    needed = {s for st in steps if st.runs_here for s in st.arg_slots}
    external = {k: s for (p, k), s in slots.items() if p is None and s in needed}
    # What a rank returns of each output: the value itself where it was produced, else the copy the rank
    # received for one of its nodes (a split-placement actor rank holds the scores computed on reward ranks).
    exports = {k: (slots[(p, k)],) + tuple(v for (s, _), v in views.items() if s == slots[(p, k)])
               for k, p in df.exports.items()}
    carried = [_Carried(p, key, slots[(p, key)], {k: s for (pp, kk, k), s in lag_slots.items() if (pp, kk) == (p, key)},
                        {k: s for (pp, kk, k), s in reads.items() if (pp, kk) == (p, key)})
               for p, key in df.carried]
    queues_out = [(ch, slots[(ch.producer, ch.key)]) for ch in channels.values() if rank in ch.src]
    return _Plan(steps, external, exports, fresh(), rank, world, distributed, world_control, carried,
                 carry_transfers, members, [q for q in queues_in if rank in q[0].dst], queues_out)


def _queue_slot(df: Dataflow, channels: dict, queues_in: list, src_slot: int, key: str, ranks: tuple[int, ...],
                size: int, distributed: bool, fresh: Any, views: dict, producer: str) -> int:
    """The slot a queued input lands in on the consumer's ranks: a view of the producer's slot, as a transfer's
    would be (one channel per producer, key and consumer rank set; creating its group is collective, so every
    rank makes it in plan order)."""
    from verl.dataflow.queue import QueueChannel
    from verl.distributed.placement import new_group
    ck = (producer, key, ranks)
    if ck not in channels:
        src = df.entry(producer).config.device_map
        union = sorted(set(src) | set(ranks))
        group = new_group(union, backend="gloo") if distributed else None
        replicated = key in df.entry(producer).config.replicated_outputs
        channels[ck] = QueueChannel(producer, key, src, ranks, size, replicated, group,
                                    comm.control_group(src) if distributed else None)
        views[(src_slot, ranks)] = fresh()
        queues_in.append((channels[ck], views[(src_slot, ranks)]))
    return views[(src_slot, ranks)]


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
_PLANS: weakref.WeakKeyDictionary[Dataflow, dict[tuple, _Plan]] = weakref.WeakKeyDictionary()


def _plan_for(df: Dataflow) -> _Plan:
    plans = _PLANS.get(df)
    if plans is None:
        plans = _PLANS[df] = {}
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not distributed:
        plan = plans.get(_LOCAL_KEY)
        if plan is not None:
            return plan
        if df.world_size > 1:
            raise VerlConfigError(f"the dataflow was built for {df.world_size} ranks but torch.distributed is not "
                                  f"initialised; launch with torchrun and call init_process_group first")
        plan = plans[_LOCAL_KEY] = _compile(df, 0, 1, False)
        return plan
    rank, world = dist.get_rank(), dist.get_world_size()
    key = (rank, world, id(dist.group.WORLD))
    plan = plans.get(key)
    if plan is None:
        bad = [e.name for e in df.entries if e.config.device_map is not None and e.config.device_map[-1] >= world]
        if bad:
            raise VerlConfigError(f"the dataflow was built for {df.world_size} ranks but runs on {world}; the "
                                  f"device_map of {bad} names ranks that do not exist here")
        plan = plans[key] = _compile(df, rank, world, True)
    return plan


# ---- node call ---------------------------------------------------------------------------------------------
def _normalize(entry: NodeEntry, out: Any) -> tuple:
    node = entry.node
    keys = node.output_keys
    if node.returns_dict:
        if (type(out) is dict or isinstance(out, Mapping)) and len(out) == len(keys):
            try:
                return tuple([out[k] for k in keys])
            except KeyError:
                pass
        got = sorted(out) if isinstance(out, Mapping) else type(out).__name__
        raise _OutputError(f"returned {got} but its outputs are {list(keys)} (read from its return statement); "
                           f"return a dict with exactly these keys, or declare @CustomNode(output_keys=[...])")
    n = len(keys)
    if n == 1:
        return (_one_output(keys[0], out),)
    if n == 0:
        if out is None or (isinstance(out, Mapping) and not out):
            return ()
        raise _OutputError(f"declares no output_keys but returned {type(out).__name__}; return None or declare "
                           f"the outputs")
    if isinstance(out, Mapping):
        if len(out) == n and all(k in out for k in keys):
            return tuple(out[k] for k in keys)
        raise _OutputError(f"returned a dict with keys {sorted(map(str, out))} but declares output_keys "
                           f"{list(keys)}; return exactly these keys")
    if isinstance(out, (tuple, list)) and len(out) == n:
        return tuple(out)
    got = f"a {type(out).__name__} of length {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__
    raise _OutputError(f"returned {got} but declares {n} output_keys {list(keys)}; return a tuple in that order "
                       f"or a dict keyed by them")


def _one_output(key: str, out: Any) -> Any:
    """The value of a one-output node: what it returned, checked here where it is made (a consumer would
    otherwise fail on it and be blamed). None is refused; so is a one-key dict whose key is a misspelling of
    the output, and a dict keyed by the output itself gives its value, as it would for several outputs."""
    if out is None:
        raise _OutputError(f"returned None for its output '{key}'; return the value (a node that makes nothing "
                           f"declares no output_keys)")
    if isinstance(out, Mapping) and len(out) == 1:
        (got,) = out
        if got == key:
            return out[got]
        if isinstance(got, str) and _misspelt(got, key):
            raise _OutputError(f"returned a dict with the one key {got!r}, close to its output '{key}'; return "
                               f"the value itself, {{'{key}': value}}, or, for a dict-valued output, "
                               f"{{'{key}': {{{got!r}: ...}}}}")
    return out


def _misspelt(a: str, b: str) -> bool:
    """`a` is one edit (insert, delete, replace) from `b`, ignoring case, or as close by difflib's ratio."""
    a, b = a.lower(), b.lower()
    if abs(len(a) - len(b)) <= 1:
        short, long_ = sorted((a, b), key=len)
        for i in range(len(long_)):
            if long_[:i] + long_[i + 1:] == short or (len(a) == len(b) >= 3 and a[:i] + b[i] + a[i + 1:] == b):
                return True
    return difflib.SequenceMatcher(None, a, b).ratio() >= 0.8


class _OutputError(Exception):
    """A node returned other outputs than it declared (never retried)."""


def _is_transient(e: BaseException, retry_on: tuple) -> bool:
    return isinstance(e, TransientError) or getattr(e, "transient", False) is True or \
        (bool(retry_on) and isinstance(e, retry_on))


def _movable(v: Any) -> bool:
    return isinstance(v, torch.nn.Module) or callable(getattr(v, "onload", None))


def _onload(objs: list, device: torch.device) -> None:
    for m in objs:
        if callable(getattr(m, "onload", None)):
            m.onload(device)
        else:
            m.to(device)


def _offload(objs: list) -> None:
    for m in objs:
        if callable(getattr(m, "offload", None)):
            m.offload()
        else:
            m.to("cpu")


def _call(step: _Step, args: list) -> tuple[tuple, int]:
    """Runs the node (with offload and retries); returns its outputs in declared order and the retry count."""
    cfg = step.entry.config
    if cfg.timeout_s > 0:
        with _Deadline(cfg.timeout_s):
            return _call_once(step, args)
    return _call_once(step, args)


def _call_once(step: _Step, args: list) -> tuple[tuple, int]:
    cfg = step.entry.config
    ctx = step.ctx
    kwargs = dict(zip(step.arg_names, args)) if step.arg_names is not None else None
    moved = []
    if cfg.cpu_offload:
        moved = [a for a in args if _movable(a)] + list(ctx._offload)
        _onload(moved, ctx.device)
    try:
        attempt = 0
        while True:
            ctx.attempt = attempt
            try:
                if kwargs is not None:
                    if step.entry.node.wants_context:
                        kwargs["ctx"] = ctx
                    out = step.fn(**kwargs, **cfg.settings) if cfg.settings else step.fn(**kwargs)
                else:
                    extra = {"ctx": ctx} if step.entry.node.wants_context else {}
                    out = step.fn(*args, **extra, **cfg.settings)
                return _normalize(step.entry, out), attempt
            except _OutputError:
                raise
            except Exception as e:  # noqa: BLE001 - classified below, re-raised when not transient
                if attempt >= cfg.retries or not _is_transient(e, cfg.retry_on):
                    raise
                time.sleep(cfg.retry_backoff_s * (2 ** attempt))
                attempt += 1
    finally:
        if cfg.cpu_offload:  # also modules the node registered during this call
            _offload(moved + [m for m in ctx._offload if not any(m is x for x in moved)])


# ---- the run -----------------------------------------------------------------------------------------------
class _Run:
    def __init__(self, df: Dataflow, plan: _Plan, hooks: Sequence[Any], recorder: TraceRecorder | None,
                 check_errors: str):
        self.df, self.plan = df, plan
        self.hooks = list(hooks) + ([recorder] if recorder is not None else [])
        self.starts = [h.on_node_start for h in self.hooks if callable(getattr(h, "on_node_start", None))]
        self.ends = [h.on_node_end for h in self.hooks if callable(getattr(h, "on_node_end", None))]
        self.moves = [h.on_transfer for h in self.hooks if callable(getattr(h, "on_transfer", None))]
        self.recorder = recorder
        self.check_each = check_errors == "node"
        self.failure: _Failure | None = None

    def fill_inputs(self, inputs: Mapping[str, Any]) -> list:
        vals = [_MISSING] * self.plan.nslots
        try:
            for k, s in self.plan.external.items():
                vals[s] = inputs[k]
        except KeyError:
            self.df.check_inputs(inputs.keys(), only=self.needed_nodes())
            raise
        return vals

    def needed_nodes(self) -> set[str]:
        return {st.entry.name for st in self.plan.steps if st.runs_here}

    def run_step(self, step: _Step, vals: list) -> None:
        args = [vals[s] for s in step.arg_slots]
        if not (self.starts or self.ends):
            start = time.monotonic()
            try:
                outs, _ = _call(step, args)
            except BaseException as exc:  # noqa: BLE001 - every node failure (sys.exit too) is agreed on
                self.fail_here(step, exc, None, time.monotonic() - start)
                if isinstance(exc, KeyboardInterrupt):
                    raise
                return
            for s, v in zip(step.out_slots, outs):
                vals[s] = v
            return
        e = step.entry
        event = NodeEvent(node=e.name, rank=self.plan.rank, ranks=step.ctx.ranks, device=str(step.ctx.device),
                          engine=e.config.engine, inputs=dict(zip(e.node.input_keys, args)),
                          start_s=time.perf_counter(), lag=e.config.lag or None)
        try:
            for h in self.starts:
                h(event)
            outs, retries = _call(step, args)
        except BaseException as exc:  # noqa: BLE001 - a failing hook fails its node like the node itself would
            self.fail_here(step, exc, event, time.perf_counter() - event.start_s)
            if isinstance(exc, KeyboardInterrupt):
                raise
            return
        for s, v in zip(step.out_slots, outs):
            vals[s] = v
        event.outputs = dict(zip(e.node.output_keys, outs))
        event.duration_s = time.perf_counter() - event.start_s
        event.retries = retries
        try:
            for h in self.ends:
                h(event)
        except Exception as exc:  # noqa: BLE001
            self.failure = _Failure(e.name, self.plan.rank, f"on_node_end hook: {type(exc).__name__}: {exc}", exc)

    def fail_here(self, step: _Step, exc: BaseException, event: NodeEvent | None, elapsed: float) -> None:
        self.failure = _Failure(step.entry.name, self.plan.rank, _describe(exc, step.entry.config, elapsed), exc)
        if event is not None:
            event.error = exc
            event.duration_s = time.perf_counter() - event.start_s
            for h in self.ends:
                try:
                    h(event)
                except Exception:  # noqa: BLE001 - the node's own error is the one to report
                    pass

    # -- distributed pieces --
    def transfer(self, t: _Transfer, vals: list) -> None:
        rank = self.plan.rank
        union = sorted(set(t.src_ranks) | set(t.dst_ranks))
        if rank not in union:
            return
        start = time.perf_counter()
        info: Any = None
        if rank in t.src_ranks:
            v = vals[t.src_slot]
            if v is _MISSING or self.failure is not None:
                f = self.failure or _Failure(t.producer, rank, "the value was not produced")
                info = ("error", f.node, f.rank, f.message)
            elif t.replicated or not comm.is_shardable(v):
                info = ("whole", 0)
            else:
                info = ("shard", comm.shard_len(v))
        infos: list[Any] = [None] * len(union)
        dist.all_gather_object(infos, info, group=t.control)
        by_rank = dict(zip(union, infos))
        errors = [i for i in infos if i is not None and i[0] == "error"]
        if errors:
            if self.failure is None:
                _, node, frank, msg = errors[0]
                self.failure = _Failure(node, frank, msg)
            return
        if by_rank[t.src_ranks[0]][0] == "whole":
            src = t.src_ranks[0]
            for d in t.dst_ranks:
                if d in t.src_ranks:
                    if d == rank:
                        vals[t.dst_slot] = vals[t.src_slot]
                elif rank == src:
                    comm.send_value(vals[t.src_slot], d)
                elif rank == d:
                    vals[t.dst_slot] = comm.recv_value(src)
        else:
            pieces = comm.plan_pieces([by_rank[s][1] for s in t.src_ranks], t.src_ranks, t.dst_ranks)
            mine = []
            for s, d, lo, hi in pieces:
                if s == rank and d == rank:
                    mine.append(vals[t.src_slot][lo:hi])
                elif s == rank:
                    comm.send_value(vals[t.src_slot][lo:hi], d)
                elif d == rank:
                    mine.append(comm.recv_value(s))
            if mine:
                vals[t.dst_slot] = comm.concat(mine)
        if self.moves:  # hooks (the trace recorder among them) see every transfer this rank took part in
            end = time.perf_counter()
            for h in self.moves:
                h(f"{t.key}: {t.producer} {list(t.src_ranks)} -> {list(t.dst_ranks)}", rank, start, end,
                  {"key": t.key, "from": list(t.src_ranks), "to": list(t.dst_ranks)})

    def agree(self, step: _Step) -> None:
        """The node's ranks learn whether any of them has failed (lowest failing rank wins)."""
        mine = self.failure.rank if self.failure is not None else _NO_FAILURE
        flag = torch.tensor([mine], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=step.control)
        frank = int(flag.item())
        if frank != _NO_FAILURE and self.failure is None:
            self.failure = _Failure("?", frank, "(details follow at the end of the run)")

    def finish_distributed(self) -> list[list[dict]] | None:
        """All ranks exchange status (and trace events); returns events per rank on rank 0 when tracing."""
        f = self.failure
        mine = None if f is None else (f.node, f.rank, f.message, f.exc is not None)
        statuses: list[Any] = [None] * len(self.plan.members)
        dist.all_gather_object(statuses, mine, group=self.plan.control)
        origins = [s for s in statuses if s is not None and s[3]]
        if origins and (f is None or f.exc is None):
            node, frank, msg, _ = min(origins, key=lambda s: s[1])
            self.failure = _Failure(node, frank, msg, None)
        elif origins and f is not None and f.exc is not None:
            first = min(origins, key=lambda s: s[1])
            if first[1] != f.rank:  # another rank failed first: report that one, everywhere alike
                self.failure = _Failure(first[0], first[1], first[2], None)
        if len(origins) > 1:  # the lowest rank is reported; the others may hold the root cause (a timeout)
            chosen = self.failure.rank
            self.failure.also = "; ".join(f"rank {r} in node '{n}': {m}" for n, r, m, _ in sorted(
                origins, key=lambda s: s[1]) if r != chosen)
        events = None
        if self.recorder is not None:
            first = self.plan.members[0]
            gathered: list[Any] | None = [None] * len(self.plan.members) if self.plan.rank == first else None
            dist.gather_object(self.recorder.events, gathered, dst=first, group=self.plan.control)
            events = gathered
        return events

    def raise_failure(self) -> None:
        f = self.failure
        if f is None:
            return
        here = f.rank == self.plan.rank and f.exc is not None
        if here and isinstance(f.exc, VerlConfigError):
            raise f.exc
        msg = f"failed: {f.message}" if here else \
            f"failed on rank {f.rank}: {f.message} (rank {self.plan.rank} stopped its run)"
        if f.also:
            msg += f"; also failed: {f.also}"
        err = VerlRuntimeError(msg, node=f.node, rank=f.rank, cause=f.exc)
        raise err from f.exc

    def collective(self, what: str, ranks: Sequence[int], fn: Any, *args: Any) -> Any:
        """Runs one of the runtime's own collectives; a failure or timeout there (a peer died, or hangs outside
        the agreement points) ends this rank's run at once with an error naming what it waited for."""
        start = time.monotonic()
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - the backend's error (timeout, closed connection) is chained
            raise self.lost_peers(what, ranks, exc, time.monotonic() - start) from exc

    def lost_peers(self, what: str, ranks: Sequence[int], exc: BaseException, waited: float) -> VerlRuntimeError:
        from verl.distributed.placement import collective_timeout
        why = " ".join(str(exc).split())[:240]
        peers = [r for r in ranks if r != self.plan.rank] or list(ranks)  # the ones it waited for, not itself
        msg = (f"lost contact with ranks {peers} while {what}, after {waited:.1f} s ({type(exc).__name__}: "
               f"{why}); a rank died or was interrupted, or stayed inside a node longer than the collective "
               f"timeout ({collective_timeout().total_seconds():g} s, trainer.collective_timeout_s)")
        f = self.failure
        if f is not None and f.exc is not None:  # this rank's own failure first: it is usually the cause
            msg = f"failed: {' '.join(f.message.split())[:240]}; then {msg}"
            return VerlRuntimeError(msg, node=f.node, rank=self.plan.rank, cause=f.exc)
        msg = f"rank {self.plan.rank} {msg}"
        return VerlRuntimeError(msg, rank=self.plan.rank, cause=exc)


def execute(df: Dataflow, inputs: Mapping[str, Any], *, trace: str | None = None, hooks: Sequence[Any] = (),
            check_errors: str = "node", state: RunState | None = None) -> dict[str, Any]:
    if check_errors not in ("node", "end"):
        raise VerlConfigError(f"check_errors must be 'node' or 'end', got {check_errors!r}")
    if type(inputs) is not dict and not isinstance(inputs, Mapping):
        raise VerlConfigError(f"run() takes a dict of inputs, got {type(inputs).__name__}")
    plan = _plan_for(df)
    if plan.carried and (state is None or state._dataflow is not df):
        lagged = sorted({f"{c.key} (from '{c.producer}')" for c in plan.carried})
        raise VerlConfigError(f"this dataflow reads {lagged} from earlier runs; pass state=flow.new_state() to run() "
                              f"and keep passing the same state object on every run" if state is None else
                              "the state passed to run() belongs to another dataflow; make it with this "
                              "dataflow's new_state()")
    recorder = TraceRecorder(run=state.runs if state is not None else 0) if trace is not None else None
    run = _Run(df, plan, hooks, recorder, check_errors)
    skipped, unavailable = _prologue(plan, state)
    if not plan.distributed:
        vals = run.fill_inputs(inputs)
        _fill_carried(plan, state, vals)
        try:
            for step in plan.steps:
                if step.entry.name in skipped:
                    continue
                run.run_step(step, vals)
                if run.failure is not None:
                    break
        finally:
            if recorder is not None:
                write_trace(trace, [recorder.events], {"dataflow": list(df.order), "world_size": 1})
        run.raise_failure()
        if state is not None:
            state._finish(plan, vals, skipped)
        return _result(plan, inputs, vals)
    if not plan.members:  # a dataflow with queues, none of whose stages runs on this rank
        return dict(inputs)
    try:
        vals = run.fill_inputs(inputs)
    except VerlConfigError as exc:
        # Raising here would leave the other ranks waiting for this one; walk the plan as a failed rank.
        vals = [_MISSING] * plan.nslots
        run.failure = _Failure("<inputs>", plan.rank, str(exc), exc)
    _fill_carried(plan, state, vals)
    for ch, s in plan.queues_in:  # the next value the producer's stage made (or its failure)
        value, failed = run.collective(f"taking {ch.name}", ch.src, ch.get)
        if failed is not None and run.failure is None:
            run.failure = _Failure(failed[0], failed[1], failed[2])
        vals[s] = value if failed is None else _MISSING
    for t in plan.carry_transfers:
        if t.src_slot not in unavailable and (plan.rank in t.src_ranks or plan.rank in t.dst_ranks):
            run.collective(f"moving '{t.key}' of an earlier run from '{t.producer}'",
                           sorted(set(t.src_ranks) | set(t.dst_ranks)), run.transfer, t, vals)
    for step in plan.steps:
        if step.entry.name in skipped:
            continue
        for t in step.transfers:
            if plan.rank in t.src_ranks or plan.rank in t.dst_ranks:
                run.collective(f"moving '{t.key}' from '{t.producer}' to '{step.entry.name}'",
                               sorted(set(t.src_ranks) | set(t.dst_ranks)), run.transfer, t, vals)
        if run.check_each and step.runs_here and step.group_size > 1:
            run.collective(f"agreeing that no rank failed before node '{step.entry.name}'", step.ctx.ranks,
                           run.agree, step)
        if step.runs_here and run.failure is None:
            run.run_step(step, vals)
    events = run.collective("exchanging the run's status at its end", plan.members, run.finish_distributed)
    if recorder is not None and plan.rank == plan.members[0]:
        write_trace(trace, events, {"dataflow": list(df.order), "world_size": plan.world_size,
                                    "ranks": list(plan.members), "run": recorder.run}, ranks=plan.members)
    for ch, s in plan.queues_out:  # after the status exchange: a failure anywhere in the stage is queued instead
        f = run.failure
        run.collective(f"putting {ch.name}", sorted(set(ch.src) | set(ch.dst)), ch.put, vals[s],
                       None if f is None else (f.node, f.rank, f.message))
        if f is not None:  # the consumer learns of it before this process can end
            try:
                flush(df)
            except VerlRuntimeError:
                pass
    run.raise_failure()
    if state is not None:
        state._finish(plan, vals, skipped)
    return _result(plan, inputs, vals)


def flush(df: Dataflow, timeout_s: float | None = None) -> None:
    """On the ranks of a queue's producer: waits until every value its runs put has been sent (call it after the
    producer's last run; the consumer must take them all). No-op elsewhere and for dataflows without queues."""
    plans = _PLANS.get(df) or {}
    if timeout_s is None:
        from verl.distributed.placement import collective_timeout
        timeout_s = collective_timeout().total_seconds()
    for plan in plans.values():
        for ch, _ in plan.queues_out:
            ch.drain(timeout_s)


def _prologue(plan: _Plan, state: RunState | None) -> tuple[set[str], set[int]]:
    """(nodes skipped this run because the state lacks an earlier run's value they need, together with what
    waits for them; the lag slots that stay empty). The same on every rank: it depends on run counts only."""
    if state is None or not plan.carried:
        return set(), set()
    skipped: set[str] = set()
    for step in plan.steps:
        if any(not state.available(p, k, lag) for p, k, lag in step.lagged):
            skipped.add(step.entry.name)
            skipped |= step.below
    unavailable = {s for c in plan.carried for lag, s in c.lag_slots.items()
                   if not state.available(c.producer, c.key, lag)}
    return skipped, unavailable


def _fill_carried(plan: _Plan, state: RunState | None, vals: list) -> None:
    if state is None:
        return
    for c in plan.carried:
        for lag, s in c.lag_slots.items():
            if state.available(c.producer, c.key, lag):
                v = state.value(c.producer, c.key, lag)
                if v is not _MISSING:
                    vals[s] = v


def _result(plan: _Plan, inputs: Mapping[str, Any], vals: list) -> dict[str, Any]:
    out = dict(inputs)
    for k, slots in plan.exports.items():
        for s in slots:
            if vals[s] is not _MISSING:
                out[k] = vals[s]
                break
    return out
