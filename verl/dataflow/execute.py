"""Running a dataflow on one rank: `execute` walks the plan (`verl.dataflow.plan`), calls the nodes
(`verl.dataflow.call`), moves values between rank sets (`verl.dataflow.transfer`) and agrees on failures.

Under torch.distributed every rank walks the same plan in the same order. Which nodes a run skips for want of an
earlier run's value depends only on how many runs the `RunState` has seen, so every rank skips the same ones;
after a successful run each producer's new value is appended to the state. With queues, agreements and the
status exchange stay among the stage's ranks, so the stages never wait for each other's runs.

Errors: a node failing on a rank becomes VerlRuntimeError(node, rank, cause chained). That rank stops running
nodes but keeps walking the plan, sending error markers where data was expected; before each multi-rank node
its ranks agree (a one-int all-reduce on a gloo control group, so a NCCL job's GPU streams are never
synchronised for it) that nobody has failed; at the end of the run all ranks exchange their
status, so every rank raises the same VerlRuntimeError instead of waiting for data that will never come.
`sys.exit()` inside a node (SystemExit) takes this path too and becomes VerlRuntimeError on every rank. A
KeyboardInterrupt (Ctrl-C, SIGINT) inside a node, or an error Python chained to one (`verl.errors.interrupt_in`),
is the one exception: it leaves the run at once on the interrupted rank, because the agreement would wait for
peers that may be busy inside their nodes for minutes, and a rank waiting in a gloo or NCCL collective cannot
be interrupted a second time. Its peers learn of it when their next collective with it fails (the connection
closes as the process exits; under torchrun the agent also stops them) and raise VerlRuntimeError saying so.

Timeouts. Guarantees:
- Every node has a time limit (``timeout_s``: an hour unless its config says otherwise, 0 only on request,
  `verl.dataflow.config.DEFAULT_NODE_TIMEOUT_S`). A node still running after that long (on one rank; retries,
  onload and offload included) is interrupted (`verl.dataflow.call`) and the run fails on every rank with
  VerlRuntimeError naming the node, the rank, the limit and the elapsed time.
- Every process group has the job's collective timeout (`verl.distributed.collective_timeout`,
  ``trainer.collective_timeout_s``). A rank whose peer died or hangs outside the agreement points leaves its
  collective after at most that long; a collective of the runtime itself (an agreement, a transfer, the final
  status exchange) that fails or times out raises VerlRuntimeError at once, naming the ranks it waited for,
  what it was doing and this rank's own failure if it had one.
Limits:
- Python cannot unwind a thread blocked inside native code: a node stuck in a collective, a CUDA
  synchronisation or a C extension is interrupted only when that call returns; collectives return at the
  latest after the collective timeout, an endless native call never (in a PPO job the hang watchdog,
  ``trainer.hang_timeout_s``, then writes the rank's stacks and ends its process). Peers then still end: they
  wait for such a rank at most one collective timeout at their next agreement point.
- A failure reaches the other ranks at their next agreement point, i.e. after their current node returns:
  with node timeouts set, a run ends at most one node timeout plus one collective timeout after a failure.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verl.dataflow.call import call, describe
from verl.dataflow.plan import MISSING, FlowGraph, Plan, PLANS, Step, Transfer, plan_for
from verl.dataflow.state import RunState
from verl.dataflow.trace import NodeEvent, TraceRecorder, write_trace
from verl.dataflow.transfer import move
from verl.errors import VerlConfigError, VerlRuntimeError, interrupt_in

__all__ = ["execute", "flush", "queued_values", "requeue"]

_NO_FAILURE = 1 << 30


@dataclass(slots=True)
class _Failure:
    node: str
    rank: int
    message: str
    exc: BaseException | None = None
    also: str = ""


class _Run:
    def __init__(self, df: FlowGraph, plan: Plan, hooks: Sequence[Any], recorder: TraceRecorder | None,
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
        vals = [MISSING] * self.plan.nslots
        try:
            for k, s in self.plan.external.items():
                vals[s] = inputs[k]
        except KeyError:
            self.df.check_inputs(inputs.keys(), only=self.needed_nodes())
            raise
        return vals

    def needed_nodes(self) -> set[str]:
        return {st.entry.name for st in self.plan.steps if st.runs_here}

    def run_step(self, step: Step, vals: list) -> None:
        args = [vals[s] for s in step.arg_slots]
        if not (self.starts or self.ends):
            start = time.monotonic()
            try:
                outs, _ = call(step, args)
            except BaseException as exc:  # noqa: BLE001 - every node failure (sys.exit too) is agreed on
                kb = interrupt_in(exc)
                self.fail_here(step, kb or exc, None, time.monotonic() - start)
                if kb is not None:
                    raise kb
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
            outs, retries = call(step, args)
        except BaseException as exc:  # noqa: BLE001 - a failing hook fails its node like the node itself would
            kb = interrupt_in(exc)
            self.fail_here(step, kb or exc, event, time.perf_counter() - event.start_s)
            if kb is not None:
                raise kb
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

    def fail_here(self, step: Step, exc: BaseException, event: NodeEvent | None, elapsed: float) -> None:
        self.failure = _Failure(step.entry.name, self.plan.rank, describe(exc, step.entry.config, elapsed), exc)
        if event is not None:
            event.error = exc
            event.duration_s = time.perf_counter() - event.start_s
            for h in self.ends:
                try:
                    h(event)
                except Exception:  # noqa: BLE001 - the node's own error is the one to report
                    pass

    # -- distributed pieces --
    def transfer(self, t: Transfer, vals: list) -> None:
        """This rank's part of moving one value between rank sets; a producer's failure becomes this run's."""
        start = time.perf_counter()
        f = self.failure
        error = move(t, vals, self.plan.rank, None if f is None else (f.node, f.rank, f.message))
        if error is not None:
            if self.failure is None:
                self.failure = _Failure(*error)
            return
        if self.moves:  # hooks (the trace recorder among them) see every transfer this rank took part in
            end = time.perf_counter()
            for h in self.moves:
                h(f"{t.key}: {t.producer} {list(t.src_ranks)} -> {list(t.dst_ranks)}", self.plan.rank, start, end,
                  {"key": t.key, "from": list(t.src_ranks), "to": list(t.dst_ranks)})

    def agree(self, step: Step) -> None:
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

    def take_queued(self, vals: list) -> None:
        """Before the run: the next value each queue's producer stage made (or its failure, in its place)."""
        for ch, s in self.plan.queues_in:
            value, failed = self.collective(f"taking {ch.name}", ch.src, ch.get)
            if failed is not None and self.failure is None:
                self.failure = _Failure(failed[0], failed[1], failed[2])
            vals[s] = value if failed is None else MISSING

    def put_queued(self, vals: list) -> None:
        """After the status exchange: a failure anywhere in the stage is queued in the value's place, and sent
        before this process can end."""
        for ch, s in self.plan.queues_out:
            f = self.failure
            self.collective(f"putting {ch.name}", sorted(set(ch.src) | set(ch.dst)), ch.put, vals[s],
                            None if f is None else (f.node, f.rank, f.message))
            if f is not None:
                try:
                    flush(self.df)
                except VerlRuntimeError:
                    pass

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


def execute(df: FlowGraph, inputs: Mapping[str, Any], *, trace: str | None = None, hooks: Sequence[Any] = (),
            check_errors: str = "node", state: RunState | None = None) -> dict[str, Any]:
    """One run of `df` on this rank (see the module docstring); what `Dataflow.run` does."""
    if check_errors not in ("node", "end"):
        raise VerlConfigError(f"check_errors must be 'node' or 'end', got {check_errors!r}")
    if type(inputs) is not dict and not isinstance(inputs, Mapping):
        raise VerlConfigError(f"run() takes a dict of inputs, got {type(inputs).__name__}")
    plan = plan_for(df)
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
        vals = _run_local(run, inputs, state, skipped, trace)
    elif not plan.members:  # a dataflow with queues, none of whose stages runs on this rank
        return dict(inputs)
    else:
        vals = _run_distributed(run, inputs, state, skipped, unavailable, trace)
    run.raise_failure()
    if state is not None:
        state.finish(plan, vals, skipped)
    return _result(plan, inputs, vals)


def _run_local(run: "_Run", inputs: Mapping[str, Any], state: RunState | None, skipped: set[str],
               trace: str | None) -> list:
    """A one-process run: the steps in order, stopping at the first failure."""
    plan, recorder = run.plan, run.recorder
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
            write_trace(trace, [recorder.events], {"dataflow": list(run.df.order), "world_size": 1})
    return vals


def _run_distributed(run: "_Run", inputs: Mapping[str, Any], state: RunState | None, skipped: set[str],
                     unavailable: set[int], trace: str | None) -> list:
    """This rank's walk of the plan with the others: queued and carried values in, then every step's transfers,
    agreement and call; at the end the status exchange, the trace and the values put into queues."""
    plan = run.plan
    try:
        vals = run.fill_inputs(inputs)
    except VerlConfigError as exc:
        # Raising here would leave the other ranks waiting for this one; walk the plan as a failed rank.
        vals = [MISSING] * plan.nslots
        run.failure = _Failure("<inputs>", plan.rank, str(exc), exc)
    _fill_carried(plan, state, vals)
    run.take_queued(vals)
    for t in plan.carry_transfers:
        if t.src_slot not in unavailable and plan.rank in t.ranks:
            run.collective(f"moving '{t.key}' of an earlier run from '{t.producer}'", t.ranks, run.transfer, t, vals)
    for step in plan.steps:
        if step.entry.name in skipped:
            continue
        for t in step.transfers:
            if plan.rank in t.ranks:
                run.collective(f"moving '{t.key}' from '{t.producer}' to '{step.entry.name}'", t.ranks,
                               run.transfer, t, vals)
        if run.check_each and step.runs_here and step.group_size > 1:
            run.collective(f"agreeing that no rank failed before node '{step.entry.name}'", step.ctx.ranks,
                           run.agree, step)
        if step.runs_here and run.failure is None:
            run.run_step(step, vals)
    events = run.collective("exchanging the run's status at its end", plan.members, run.finish_distributed)
    if run.recorder is not None and plan.rank == plan.members[0]:
        write_trace(trace, events, {"dataflow": list(run.df.order), "world_size": plan.world_size,
                                    "ranks": list(plan.members), "run": run.recorder.run}, ranks=plan.members)
    run.put_queued(vals)
    return vals


def flush(df: FlowGraph, timeout_s: float | None = None) -> None:
    """On the ranks of a queue's producer: waits until every value its runs put has been sent (call it after the
    producer's last run; the consumer must take them all). No-op elsewhere and for dataflows without queues."""
    plans = PLANS.get(df) or {}
    if timeout_s is None:
        from verl.distributed.placement import collective_timeout
        timeout_s = collective_timeout().total_seconds()
    for plan in plans.values():
        for ch, _ in plan.queues_out:
            ch.drain(timeout_s)


def queued_values(df: FlowGraph, last: int) -> dict[str, list]:
    """On a queue producer's ranks: this rank's shares of the values its last `last` runs put into each queue,
    {"producer/key": [oldest, ..., newest]} (what a checkpoint keeps of values the consumer has not used yet);
    {} elsewhere. `last` is at most the queue's size + 1 (older values are no longer kept)."""
    out = {}
    for ch, _ in plan_for(df).queues_out:
        if last > len(ch.journal) and last > 0:
            raise VerlRuntimeError(f"{ch.name}: {last} values asked for, but the producer's ranks keep the last "
                                   f"{ch.journal.maxlen} (and have put {len(ch.journal)})")
        out[f"{ch.producer}/{ch.key}"] = list(ch.journal)[len(ch.journal) - last:] if last > 0 else []
    return out


def requeue(df: FlowGraph, values: Mapping[str, list]) -> int:
    """On a queue producer's ranks, before its first run in a resumed process: puts `values` (what `queued_values`
    gave in the process that saved them, this rank's shares) into their queues again, in order, so the consumer takes
    them as if the runs that made them had happened. Collective over the producer's ranks (and, on a first use,
    every rank: the plan is compiled). Returns how many runs' values went in."""
    chans = {f"{ch.producer}/{ch.key}": ch for ch, _ in plan_for(df).queues_out}
    if set(values) != set(chans):
        raise VerlConfigError(f"the saved queue holds {sorted(values)} but this dataflow's producer here puts into "
                              f"{sorted(chans)}; resume with the dataflow it was saved with")
    counts = {len(v) for v in values.values()}
    if len(counts) > 1:
        raise VerlConfigError(f"the saved queue holds different numbers of values per key: "
                              f"{ {k: len(v) for k, v in values.items()} }")
    n = counts.pop() if counts else 0
    for i in range(n):  # run by run, as the runs put them
        for name, ch in chans.items():
            ch.put(values[name][i])
    return n


def _prologue(plan: Plan, state: RunState | None) -> tuple[set[str], set[int]]:
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


def _fill_carried(plan: Plan, state: RunState | None, vals: list) -> None:
    if state is None:
        return
    for c in plan.carried:
        for lag, s in c.lag_slots.items():
            if state.available(c.producer, c.key, lag):
                v = state.value(c.producer, c.key, lag)
                if v is not MISSING:
                    vals[s] = v


def _result(plan: Plan, inputs: Mapping[str, Any], vals: list) -> dict[str, Any]:
    out = dict(inputs)
    for k, slots in plan.exports.items():
        for s in slots:
            if vals[s] is not MISSING:
                out[k] = vals[s]
                break
    return out
