"""Values a dataflow carries from one run to the next (lagged inputs): `RunState`, which the caller keeps.

    state = flow.new_state()                 # or flow.new_state(initial={"batch": b0}) to skip the prologue
    flow.run(inputs, state=state)            # every run, the same state
    ckpt = state.state_dict(); state.load_state_dict(ckpt)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verl.dataflow.plan import MISSING, FlowGraph, Plan
from verl.errors import VerlConfigError

__all__ = ["RunState"]


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

    def __init__(self, dataflow: FlowGraph, initial: Mapping[str, Any] | None = None):
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
        return {"runs": self.runs, "carried": {f"{p}/{k}": [None if v is MISSING else v for v in h]
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

    def finish(self, plan: Plan, vals: list, skipped: set[str]) -> None:
        """Appends a successful run's new values of the carried keys (not those of skipped producers)."""
        for c in plan.carried:
            if c.producer not in skipped:
                self._history[(c.producer, c.key)].append(vals[c.slot])
            for k, s in c.reads.items():
                v = vals[s]
                if v is MISSING:
                    self._read.pop((c.key, k), None)
                else:
                    self._read[(c.key, k)] = v
        self.runs += 1
