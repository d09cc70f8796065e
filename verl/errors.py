"""Exceptions shared by every verl layer."""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterable


class VerlError(Exception):
    """Base class of verl's own errors."""


class VerlConfigError(VerlError, ValueError):
    """A configuration, graph or argument error found before any work starts; the message says what to change."""


class VerlRuntimeError(VerlError, RuntimeError):
    """A failure inside a dataflow node or an engine.

    Names the node, the rank and the cause; the original exception is chained as ``__cause__``.
    """

    def __init__(self, message: str, *, node: str | None = None, rank: int | None = None,
                 cause: BaseException | None = None):
        self.node = node
        self.rank = rank
        self.cause = cause
        parts = []
        if node is not None:
            parts.append(f"node '{node}'")
        if rank is not None:
            parts.append(f"rank {rank}")
        prefix = f"[{', '.join(parts)}] " if parts else ""
        super().__init__(prefix + message)

    def __reduce__(self):  # picklable across processes (multi-rank error propagation)
        return (_rebuild_runtime_error, (self.args[0], self.node, self.rank))


def _rebuild_runtime_error(message, node, rank):
    err = VerlRuntimeError.__new__(VerlRuntimeError)
    RuntimeError.__init__(err, message)
    err.node, err.rank, err.cause = node, rank, None
    return err


def first_line(e: BaseException) -> str:
    """An exception's first line (libraries such as transformers append paragraphs of advice; the whole text stays
    chained)."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""


@contextlib.contextmanager
def library_errors(what: str, fix: str = ""):
    """Re-raises what a third-party library raises inside the block as VerlConfigError naming `what` (the file
    or directory and its role, e.g. "reward.model_path='/x'"), with the library's first line and `fix`; the
    library's exception stays chained. verl's own errors pass through."""
    try:
        yield
    except VerlError:
        raise
    except Exception as e:  # noqa: BLE001 - every library failure gets the path it was about
        raise VerlConfigError(f"{what}: {type(e).__name__}: {first_line(e)}" + (f"; {fix}" if fix else "")) from e


def nearest(name: object, candidates: Iterable[object], what: str = "") -> str:
    """' (did you mean 'x'?)' for the closest candidate, or the list of valid names when none is close: the
    tail of an error message about a misspelt name."""
    cands = sorted({str(c) for c in candidates})
    close = difflib.get_close_matches(str(name), cands, n=1, cutoff=0.5)
    if close:
        return f" (did you mean '{close[0]}'?)"
    if not cands:
        return f" (there are no {what or 'names'})"
    shown = cands if len(cands) <= 12 else cands[:12] + ["..."]
    return f" ({what or 'valid names'}: {', '.join(shown)})"


def interrupt_in(exc: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt (Ctrl-C, SIGINT) behind ``exc``, if any: ``exc`` itself or one it was raised from or
    while handling. Python wraps an exception in some places (a class body's ``__set_name__`` turns it into a
    RuntimeError chained to it), so a Ctrl-C that lands there must still read as an interrupt."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def run_cli(main, argv: list[str] | None = None, prog: str = "verl") -> int:
    """Runs a command-line `main(argv)`: verl's own errors print as one short message on stderr (the message names
    the key or node and the fix; a traceback would bury it) and give exit code 2 (config) or 1 (runtime); Ctrl-C
    prints one line and gives 130 (128 + SIGINT). VERL_TRACEBACK=1 re-raises them with the full traceback."""
    import os
    import sys
    try:
        try:
            return main(argv) or 0
        except Exception as e:
            kb = interrupt_in(e)
            if kb is None:
                raise
            raise kb
    except VerlError as e:
        if os.environ.get("VERL_TRACEBACK", "") not in ("", "0"):
            raise
        config = isinstance(e, VerlConfigError)
        # A config error is the same on every rank of a torchrun job: print it once.
        if not (config and os.environ.get("RANK", "0") != "0"):
            print(f"{prog}: {'config error' if config else 'error'}: {_with_cause(e)}\n"
                  f"(set VERL_TRACEBACK=1 for the full traceback)", file=sys.stderr)
        _restarts_used_up(prog)
        return 2 if config else 1
    except KeyboardInterrupt:
        if os.environ.get("VERL_TRACEBACK", "") not in ("", "0"):
            raise
        print(f"{prog}: interrupted (Ctrl-C / SIGINT); stopped (set VERL_TRACEBACK=1 for the full traceback)",
              file=sys.stderr)
        return 130


def _restarts_used_up(prog: str) -> None:
    """Under `torchrun --max-restarts=N`, the last worker group's rank 0 says that no restart is left."""
    import os
    import sys
    try:
        count, limit = (int(os.environ.get(k, "0"))
                        for k in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"))
    except ValueError:
        return
    if limit > 0 and count >= limit and os.environ.get("RANK", "0") == "0":
        print(f"{prog}: torchrun's restarts are used up ({count} of --max-restarts={limit}; each earlier fault is a "
              f"'torchrun restart K' line above): the job ends here; continue it with trainer.resume=auto, or raise "
              f"--max-restarts", file=sys.stderr)


def _with_cause(e: BaseException) -> str:
    msg = str(e)
    cause = e.__cause__
    if cause is not None and str(cause) not in msg:
        msg += f"\n  caused by {type(cause).__name__}: {cause}"
    return msg
