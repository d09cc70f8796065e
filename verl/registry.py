"""The one registry class: names chosen in configs → objects (algorithms, rewards, tools, environments, engines).

    LOSSES = Registry("policy loss", key="actor.policy_loss", required=("logprob", "advantages"))

    @LOSSES.register("my_loss", "alias")          # decorator form (functions, classes)
    def my_loss(logprob, advantages, ...): ...

    SOURCES.add("toy", ToySource, weight=0.5)     # plain form (objects that are not defined at the call)
    LOSSES.get("my_loss"); LOSSES.meta("my_loss"); LOSSES.names()

Re-registering a name with another object is an error naming both registrants (a silent replacement would make
the outcome depend on import order). Unknown names raise `VerlConfigError` naming the config key, the nearest
spelling and every known name. A registry built with `refs=True` also resolves ``module:attr`` references to user
code (`import_ref`), so a torchrun-spawned process reaches the same function by importing it.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

from verl.errors import VerlConfigError

__all__ = ["Registry", "import_ref"]

T = TypeVar("T")


def import_ref(ref: str, what: str = "object", key: str | None = None) -> object:
    """The attribute `attr` of module `module` for ``module:attr`` (dots in `attr` walk nested attributes)."""
    label = f"{key}={ref!r}" if key else repr(ref)
    module, sep, attr = str(ref).partition(":")
    if not sep or not module or not attr:
        raise VerlConfigError(f"{label}: a reference to user code is written 'module:attr' (e.g. my_pkg.rewards:fn)")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise VerlConfigError(f"{label}: cannot import module {module!r} for the {what} ({type(e).__name__}: {e}); "
                              f"it must be importable from the Python path") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise VerlConfigError(f"{label}: module {module!r} has no attribute {attr!r} (the {what})")
        obj = getattr(obj, part)
    return obj


class Registry(Generic[T]):
    """Objects of one kind (`what`, e.g. "advantage estimator"), chosen by the config key `key`.

    `required` names the parameters every registered callable must accept (checked at registration, so a
    mismatched signature fails at import, not in the middle of a run); `meta_type` is the record type of the
    keyword metadata given at registration (None: registrations take none).
    """

    def __init__(self, what: str, required: Iterable[str] = (), meta_type: type | None = None,
                 key: str | None = None, refs: bool = False):
        self.what, self.key, self.refs = what, key, refs
        self.required = tuple(required)
        self.meta_type = meta_type
        self._objs: dict[str, T] = {}
        self._meta: dict[str, object] = {}

    def register(self, name: str, *aliases: str, **meta) -> Callable[[T], T]:
        """Decorator: registers the decorated object under `name` and `aliases` with metadata `meta`."""
        record = self._record(meta)

        def deco(obj: T) -> T:
            self._add(obj, (name, *aliases), record)
            return obj
        return deco

    def add(self, name: str, obj: T, *aliases: str, **meta) -> T:
        """Registers `obj` under `name` and `aliases` (the non-decorator form)."""
        self._add(obj, (name, *aliases), self._record(meta))
        return obj

    def _record(self, meta: dict):
        if meta and self.meta_type is None:
            raise VerlConfigError(f"{self.what} registrations take no metadata (got {sorted(meta)})")
        return self.meta_type(**meta) if self.meta_type is not None else None

    def _add(self, obj: T, names: tuple[str, ...], record) -> None:
        for n in names:
            if not isinstance(n, str) or not n or ":" in n:
                raise VerlConfigError(f"{self.what} name {n!r} must be a non-empty string without ':' "
                                      f"(':' marks a module:attr reference)")
        self._check_signature(names[0], obj)
        for n in names:
            old = self._objs.get(n)
            if old is not None and old is not obj:
                raise VerlConfigError(f"{self.what} {n!r} is already registered (by {_label(old)}); "
                                      f"{_label(obj)} must pick another name")
        for n in names:
            self._objs[n] = obj
            self._meta[n] = record

    def _check_signature(self, name: str, obj) -> None:
        if not self.required or not callable(obj):
            return
        params = inspect.signature(obj).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return
        missing = [r for r in self.required if r not in params]
        if missing:
            raise VerlConfigError(f"{self.what} {name!r} ({_label(obj)}) must accept the parameters "
                                  f"{', '.join(self.required)}; missing: {', '.join(missing)}")

    def get(self, name: str) -> T:
        """The object registered as `name`; with `refs`, also a ``module:attr`` reference (imported)."""
        if isinstance(name, str) and name in self._objs:
            return self._objs[name]
        if self.refs and isinstance(name, str) and ":" in name:
            obj = import_ref(name, self.what, self.key)
            self._check_signature(name, obj)
            return obj
        near = difflib.get_close_matches(str(name), self.names(), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        where = f"{self.key}=" if self.key else ""
        extra = " or a 'module:attr' reference to your own" if self.refs else ""
        raise VerlConfigError(f"unknown {self.what} {where}{name!r}{hint}; known: {', '.join(self.names())}{extra}")

    def meta(self, name: str):
        """The metadata record `name` was registered with (unknown names raise like `get`)."""
        self.get(name)
        return self._meta.get(name)

    def names(self) -> list[str]:
        return sorted(self._objs)

    def items(self) -> Iterator[tuple[str, T]]:
        return iter(sorted(self._objs.items()))

    def __contains__(self, name: object) -> bool:
        return name in self._objs

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def _label(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"
