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

    def __init__(self, what: str, required: Iterable[str] = (), meta_type: type | None = None):
        self.what = what
        self.required = tuple(required)
        self.meta_type = meta_type
        self._fns: dict[str, F] = {}
        self._meta: dict[str, object] = {}

    def register(self, name: str, *aliases: str, **meta) -> Callable[[F], F]:
        """Registers under `name` and `aliases`; `meta` fills this kind's metadata record (`meta_type`)."""
        record = self.meta_type(**meta) if self.meta_type is not None else None
        if meta and self.meta_type is None:
            raise VerlConfigError(f"{self.what} registrations take no metadata (got {sorted(meta)})")

        def deco(fn: F) -> F:
            self._check_signature(name, fn)
            for n in (name, *aliases):
                if n in self._fns and self._fns[n] is not fn:
                    raise VerlConfigError(f"{self.what} {n!r} is already registered (by "
                                          f"{self._fns[n].__module__}.{self._fns[n].__qualname__}); pick another name")
                self._fns[n] = fn
                self._meta[n] = record
            return fn
        return deco

    def meta(self, name: str):
        """The metadata record `name` was registered with (unknown names raise like `get`)."""
        self.get(name)
        return self._meta[name]

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
