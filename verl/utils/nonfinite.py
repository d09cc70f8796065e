"""The non-finite guard of the training engines: an optimizer step whose loss or gradient norm is not finite on
any rank of an engine is skipped on all of them, and a worker fails the run after `trainer.max_nonfinite_steps`
such steps in a row.

What a rank found is described as (priority, text); the ranks agree on the lowest (priority, rank), so every
rank reports the same first non-finite quantity:

    LOSS       a micro-batch's loss (the likeliest origin: bad advantages, log-ratios, values)
    OWN_GRAD   a gradient this rank computed, before the data-parallel averaging spread it (torch engine)
    GRAD       a gradient (or this rank's shard of one) after the reduction
    NORM       only the norm (the non-finite entries live in another rank's shards)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from verl.distributed.collectives import agree_first
from verl.errors import VerlRuntimeError

__all__ = ["GRAD", "LOSS", "NORM", "OWN_GRAD", "NonfiniteGuard", "agree_nonfinite", "first_nonfinite_grad",
           "local_problem", "loss_problem"]

LOSS, OWN_GRAD, GRAD, NORM = range(4)

NamedGrads = Iterable[tuple[str, "torch.Tensor | None"]]
"""(parameter name, its gradient or None) pairs."""


def loss_problem(losses: Sequence[torch.Tensor]) -> str | None:
    """The first non-finite micro-batch loss among `losses` (scalars), described; None when all are finite.
    One host sync for all of them."""
    if not losses:
        return None
    values = torch.stack([v.detach().float().reshape(()) for v in losses])
    bad = (~torch.isfinite(values)).nonzero()
    if len(bad) == 0:
        return None
    i = int(bad[0])
    return f"the loss of micro-batch {i} is {float(values[i])}"


def first_nonfinite_grad(named_grads: NamedGrads) -> str | None:
    """The first gradient with a NaN or inf entry (for a DTensor, this rank's shard), described by the
    parameter's name; None when all are finite."""
    for name, g in named_grads:
        if g is None:
            continue
        g = g.to_local() if hasattr(g, "to_local") else g
        finite = torch.isfinite(g)
        if not bool(finite.all()):
            return f"the gradient of {name!r} has {int((~finite).sum())} non-finite of {g.numel()} entries"
    return None


def local_problem(losses: Sequence[torch.Tensor], grad_norm: float, named_grads: NamedGrads,
                  own: str | None = None) -> tuple[int, str] | None:
    """This rank's (priority, text) for `agree_nonfinite`, or None when its step is finite: its micro-batch
    `losses`, then `own` (its gradient before the reduction, where the engine saw it), then the gradients
    (`named_grads`, only scanned when `grad_norm` is not finite)."""
    bad_loss = loss_problem(losses)
    if bad_loss is not None:
        return LOSS, bad_loss
    if own is not None:
        return OWN_GRAD, own
    if math.isfinite(grad_norm):
        return None
    found = first_nonfinite_grad(named_grads)
    return (GRAD, found) if found else (NORM, f"the gradient norm is {grad_norm}")


def agree_nonfinite(local: tuple[int, str] | None, rank: int, groups) -> str | None:
    """What the engine's ranks found, agreed over `groups` (see `agree_first`): `local` is this rank's
    (priority, text) or None. Returns '<text> on rank <rank>' for the lowest (priority, rank), the same on every
    rank, or None when every rank's step is finite."""
    best = agree_first(None if local is None else (local[0], rank, local[1]), groups)
    return None if best is None else f"{best[2]} on rank {best[1]}"


class NonfiniteGuard:
    """A worker's count of its engine's skipped optimizer steps; fails the run at `limit` skipped in a row.

    In a row, not in total: a rare bad batch in a long run is skipped and forgotten, while a run whose every
    step is non-finite (diverged weights, a broken reward) stops within `limit` steps."""

    def __init__(self, role: str, limit: int):
        self.role, self.limit = role, limit
        self.skipped = 0
        """Optimizer steps skipped so far (the metrics report the difference per training step)."""
        self.streak = 0
        self.first: str | None = None
        self.steps = 0

    def record(self, nonfinite: str | None, step: int | None = None) -> bool:
        """Counts one optimizer step (`nonfinite`: None if applied, else what the engine reported, the same on
        every rank; `step`: the training step, 0-based, for the message). True when it was applied."""
        self.steps += 1
        if nonfinite is None:
            self.streak, self.first = 0, None
            return True
        self.skipped += 1
        self.streak += 1
        where = f"optimizer step {self.steps}" + ("" if step is None else f" (training step {step + 1})")
        if self.first is None:
            self.first = f"{where}: {nonfinite}"
        if self.streak >= self.limit:
            raise VerlRuntimeError(
                f"{self.role}: {self.streak} optimizer steps in a row had a non-finite loss or gradient norm and were "
                f"skipped (trainer.max_nonfinite_steps={self.limit}); the first at {self.first}, the last at "
                f"{where}: {nonfinite}. The skipped steps left the weights unchanged. Lower {self.role}.optim.lr "
                f"or clip gradients ({self.role}.optim.grad_clip), check these steps' rewards and data, or resume "
                f"from the last checkpoint")
        return False
