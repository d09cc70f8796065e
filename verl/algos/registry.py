"""A tiny name -> function registry: the trainer picks algorithms by config string, adding one is one function.

Unknown names raise `VerlConfigError` listing the known names (and the nearest spelling).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from verl.errors import VerlConfigError

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Functions of one kind (`what`, e.g. "advantage estimator"), all with the same calling convention.

    `required` names the parameters every registered function must accept (checked at registration, so a
    mismatched signature fails at import, not in the middle of a run).
    """

    def __init__(self, what: str, required: Iterable[str] = ()):
        self.what = what
        self.required = tuple(required)
        self._fns: dict[str, F] = {}

    def register(self, name: str, *aliases: str) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            self._check_signature(name, fn)
            for n in (name, *aliases):
                if n in self._fns and self._fns[n] is not fn:
                    raise VerlConfigError(f"{self.what} {n!r} is already registered (by "
                                          f"{self._fns[n].__module__}.{self._fns[n].__qualname__}); pick another name")
                self._fns[n] = fn
            return fn
        return deco

    def _check_signature(self, name: str, fn: Callable) -> None:
        params = inspect.signature(fn).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return
        missing = [r for r in self.required if r not in params]
        if missing:
            raise VerlConfigError(f"{self.what} {name!r} ({fn.__qualname__}) must accept the parameters "
                                  f"{', '.join(self.required)}; missing: {', '.join(missing)}")

    def get(self, name: str) -> F:
        try:
            return self._fns[name]
        except KeyError:
            near = difflib.get_close_matches(str(name), self.names(), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise VerlConfigError(f"unknown {self.what} {name!r}{hint}; known: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._fns)

    def __contains__(self, name: str) -> bool:
        return name in self._fns
