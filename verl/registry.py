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

Where code named in a config may come from (one rule, whatever the entry point): the documented search path, i.e.
``sys.path`` less the current directory, which ``python -m verl.trainer.main_ppo`` (and ``python -c``) put there
implicitly while the ``verl`` script does not. So PYTHONPATH, the installed packages and the standard library;
the current directory only when asked, by naming it in PYTHONPATH (``PYTHONPATH=. verl train ...``). The check
runs before the module's code does; the file a reference was loaded from is logged once per process.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Generic, TypeVar

from verl.errors import VerlConfigError

__all__ = ["Registry", "import_module_checked", "import_ref"]

T = TypeVar("T")


def import_ref(ref: str, what: str = "object", key: str | None = None) -> object:
    """The attribute `attr` of module `module` for ``module:attr`` (dots in `attr` walk nested attributes),
    imported from the documented search path only (see the module docstring)."""
    label = f"{key}={ref!r}" if key else repr(ref)
    module, sep, attr = str(ref).partition(":")
    if not sep or not module or not attr:
        raise VerlConfigError(f"{label}: a reference to user code is written 'module:attr' (e.g. my_pkg.rewards:fn)")
    obj = import_module_checked(module, f"{label}: ", what)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise VerlConfigError(f"{label}: module {module!r} has no attribute {attr!r} (the {what})")
        obj = getattr(obj, part)
    _log_origin(label, obj)
    return obj


def import_module_checked(module: str, label: str = "", what: str = "code") -> object:
    """`importlib.import_module(module)` after checking that it comes from the documented search path; errors
    (VerlConfigError) start with `label`."""
    try:
        refused = _from_current_dir(module)
    except (ImportError, ValueError) as e:  # find_spec imports parent packages; a bad name raises ValueError
        raise VerlConfigError(f"{label}cannot import module {module!r} for the {what} ({type(e).__name__}: {e}); "
                              f"it must be importable from the Python path") from e
    if refused is not None:
        raise VerlConfigError(f"{label}module {module!r} is in the current directory ({refused}), "
                              f"which is not on verl's search path for code named in configs (PYTHONPATH, the "
                              f"installed packages); to use it, ask for the current directory explicitly: "
                              f"PYTHONPATH={os.getcwd()} (or PYTHONPATH=.), or install it as a package")
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise VerlConfigError(f"{label}cannot import module {module!r} for the {what} ({type(e).__name__}: {e}); "
                              f"it must be importable from the Python path") from e


def _from_current_dir(module: str) -> str | None:
    """The file or folder through which `module` would come from the current directory's implicit sys.path
    entry; None when it comes from elsewhere, or the current directory was asked for in PYTHONPATH. Walks the
    dotted name down from the top-level package without running any code: only namespace packages (which have
    none) are imported on the way, and they can take their submodules from several entries."""
    if module.partition(".")[0] == "verl":  # verl's own modules (the engine table's factories): the product itself
        return None
    cwd = os.path.realpath(os.getcwd())
    if cwd in {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}:
        return None
    parts = module.split(".")
    suspect = [cwd]  # folders that count as the current directory's: the entry, then namespace portions in it
    for i in range(1, len(parts) + 1):
        origin, portions = _location(".".join(parts[:i]))
        if origin is None and portions is None and i == 1:  # not on sys.path (the `verl` script's case): is it here?
            spec = importlib.machinery.PathFinder.find_spec(parts[0], [cwd])
            return (spec.origin or str(Path(cwd) / parts[0])) if spec is not None else None
        if origin is None and portions is None:
            return None  # built-in, or not found (import_module says so)
        if origin is not None:  # a regular module or package: where its file lies decides
            base = os.path.dirname(origin)
            container = os.path.dirname(base) if portions is not None else base
            return origin if os.path.realpath(container) in suspect else None
        suspect = [os.path.realpath(p) for p in portions
                   if any(os.path.realpath(p) == os.path.join(d, parts[i - 1]) for d in suspect)]
        if not suspect:
            return None
    return None


def _location(name: str) -> tuple[str | None, list[str] | None]:
    """(file, package folders) of module `name`: (file, None) for a module, (__init__ file, [folder]) for a
    package, (None, folders) for a namespace package, (None, None) for a built-in or a module not found."""
    mod = sys.modules.get(name)
    if mod is not None:
        path = getattr(mod, "__path__", None)
        return getattr(mod, "__file__", None), (list(path) if path is not None else None)
    spec = importlib.util.find_spec(name)
    if spec is None:
        return None, None
    locations = spec.submodule_search_locations
    origin = spec.origin if spec.has_location else None
    return origin, (list(locations) if locations is not None else None)


_LOGGED: set[str] = set()


def _log_origin(label: str, obj: object) -> None:
    """Says once per process (rank 0 of a torchrun job) which file a config's reference was loaded from."""
    if label in _LOGGED or os.environ.get("RANK", "0") != "0":
        return
    _LOGGED.add(label)
    try:
        where = inspect.getsourcefile(obj) or inspect.getfile(obj)
    except TypeError:  # a built-in, or an instance without a defining file
        where = getattr(sys.modules.get(getattr(obj, "__module__", "") or ""), "__file__", None) or "built-in"
    print(f"verl: {label} loaded from {where}", flush=True)


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
