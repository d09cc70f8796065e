"""Values that come back from disk, checked before use; sizes of what goes to disk, bounded before it is written.

Restoring: every value a checkpoint or run manifest gives back is checked against a small spec of its type and
range (`Int(0, MAX_STEP)`, `Dict({...})`, ...) by `validate`, which names the value's path in the file and what
was wanted (``sampler.cursor = -3: must be an integer in [0, 64]``). The specs sit next to the code that reads
the values (`BatchSampler.state_spec`, the checkpoint manifest, the RNG states), and a JSON file is read by
`read_json`, which refuses a file above its size bound before parsing it.

Saving: `json_size` measures the JSON text a value would become without writing it, visiting each shared
object once (a YAML alias bomb is a small graph of shared lists that expands to gigabytes of text), and
`check_json_size` names the key that makes a value too big.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_STEP = 2**40
"""The largest step, epoch or counter a restored state may hold (far above any run; a crafted 1e30 is not)."""


class StateError(ValueError):
    """A restored value of the wrong type or range, or a value too big to write; `where` is its path."""

    def __init__(self, where: str, why: str):
        self.where, self.why = where, why
        super().__init__(f"{where}: {why}" if where else why)


class Spec:
    """What one value must be; `check(value, where)` raises StateError."""

    def check(self, value: Any, where: str) -> None:
        raise NotImplementedError


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Int(Spec):
    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi

    def check(self, value, where):
        if type(value) is not int or not self.lo <= value <= self.hi:  # bool is an int subclass: refused too
            raise StateError(where, f"{_show(value)}: must be an integer in [{self.lo}, {self.hi}]")


class Float(Spec):
    """A finite number in [lo, hi] (integers count)."""

    def __init__(self, lo: float = -math.inf, hi: float = math.inf):
        self.lo, self.hi = lo, hi

    def check(self, value, where):
        ok = type(value) in (int, float) and math.isfinite(value) and self.lo <= value <= self.hi
        if not ok:
            raise StateError(where, f"{_show(value)}: must be a finite number in [{self.lo}, {self.hi}]")


class Bool(Spec):
    def check(self, value, where):
        if type(value) is not bool:
            raise StateError(where, f"{_show(value)}: must be true or false")


class Str(Spec):
    def __init__(self, max_len: int = 256, pattern: str | None = None, choices: tuple[str, ...] = ()):
        self.max_len, self.choices = max_len, choices
        self.pattern = re.compile(pattern) if pattern else None

    def check(self, value, where):
        if type(value) is not str or len(value) > self.max_len:
            raise StateError(where, f"{_show(value)}: must be a string of at most {self.max_len} characters")
        if self.choices and value not in self.choices:
            raise StateError(where, f"{_show(value)}: must be one of {', '.join(map(repr, self.choices))}")
        if self.pattern is not None and not self.pattern.fullmatch(value):
            raise StateError(where, f"{_show(value)}: must match {self.pattern.pattern}")


class Opt(Spec):
    """None or `inner`."""

    def __init__(self, inner: Spec):
        self.inner = inner

    def check(self, value, where):
        if value is not None:
            self.inner.check(value, where)


class List(Spec):
    def __init__(self, item: Spec, max_len: int = 1 << 20, length: int | None = None):
        self.item, self.max_len, self.length = item, max_len, length

    def check(self, value, where):
        if type(value) is not list:
            raise StateError(where, f"{_show(value)}: must be a list")
        if self.length is not None and len(value) != self.length:
            raise StateError(where, f"a list of {len(value)} items: must hold exactly {self.length}")
        if len(value) > self.max_len:
            raise StateError(where, f"a list of {len(value)} items: must hold at most {self.max_len}")
        for i, v in enumerate(value):
            self.item.check(v, f"{where}[{i}]")


class Dict(Spec):
    """A JSON object with the keys of `fields` (those in `optional` may be absent); other keys are refused unless
    `extra` (the spec of their values) is given."""

    def __init__(self, fields: dict[str, Spec], optional: tuple[str, ...] = (), extra: Spec | None = None,
                 max_len: int = 1 << 20):
        self.fields, self.optional, self.extra, self.max_len = fields, optional, extra, max_len

    def check(self, value, where):
        if type(value) is not dict:
            raise StateError(where, f"{_show(value)}: must be a JSON object")
        missing = [k for k in self.fields if k not in value and k not in self.optional]
        if missing:
            raise StateError(where, f"lacks {', '.join(map(repr, missing))}")
        if len(value) > self.max_len:
            raise StateError(where, f"an object of {len(value)} keys: must hold at most {self.max_len}")
        for k, v in value.items():
            at = f"{where}.{k}" if where else str(k)
            spec = self.fields.get(k, self.extra)
            if spec is None:
                raise StateError(at, f"unexpected key (expected {', '.join(map(repr, self.fields))})")
            spec.check(v, at)


class Json(Spec):
    """Any JSON data (informational values nothing acts on, e.g. the config a checkpoint was written with)."""

    def check(self, value, where):
        json_size(value, where=where)


class Each(Spec):
    """A value checked by a function (for ranges known only to the object restored, e.g. a dataset's size)."""

    def __init__(self, fn: Callable[[Any, str], None]):
        self.fn = fn

    def check(self, value, where):
        self.fn(value, where)


def validate(value: Any, spec: Spec, where: str = "") -> Any:
    """`value` if it meets `spec`; StateError naming the first value that does not."""
    spec.check(value, where)
    return value


# -- sizes ------------------------------------------------------------------------------------------------------
_LEAF = (str, int, float, bool, type(None))


def _leaf_size(v: Any) -> int:
    if isinstance(v, str):
        return len(json.dumps(v))
    if v is None or v is True:
        return 4
    if v is False:
        return 5
    if isinstance(v, int):
        if v.bit_length() > 10_000:  # digits, without building a huge decimal string
            return v.bit_length() * 30103 // 100000 + 2
        return len(str(v))
    return len(json.dumps(v))


def json_size(obj: Any, limit: float = math.inf, where: str = "") -> int:
    """The length of ``json.dumps(obj, separators=(",", ":"))``, computed visiting each object once (shared
    subtrees are counted as often as they occur, as the text would repeat them). StateError for data that is not
    JSON (naming its path), for an object that contains itself, and as soon as the total passes `limit`."""
    sizes: dict[int, int] = {}
    active: set[int] = set()
    stack: list[tuple[Any, str, bool]] = [(obj, where, False)]
    while stack:
        node, path, done = stack.pop()
        if isinstance(node, _LEAF):
            continue
        key = id(node)
        if done:
            active.discard(key)
            items = node.items() if isinstance(node, dict) else enumerate(node)
            # compact JSON: brackets, a comma between items, "key": before each value of an object
            total = 1 + sum(_child_size(v, sizes) + (_leaf_size(str(k)) + 2 if isinstance(node, dict) else 1)
                            for k, v in items) + (1 if not len(node) else 0)
            sizes[key] = total
            if total > limit:
                raise StateError(path, f"holds about {total / 2**20:.1f} MB of JSON, above the limit of "
                                       f"{limit / 2**20:.1f} MB")
            continue
        if key in sizes:
            continue
        if key in active:
            raise StateError(path, "contains itself (a recursive YAML alias?); it cannot be written as JSON")
        if not isinstance(node, (dict, list, tuple)):
            raise StateError(path, f"is a {type(node).__name__}, not JSON data (numbers, strings, lists, mappings)")
        if isinstance(node, dict) and not all(isinstance(k, _LEAF) for k in node):
            bad = next(k for k in node if not isinstance(k, _LEAF))
            raise StateError(path, f"has a key of type {type(bad).__name__}; JSON keys are strings")
        active.add(key)
        stack.append((node, path, True))
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            if not isinstance(v, _LEAF) and id(v) not in sizes:
                stack.append((v, f"{path}.{k}" if isinstance(node, dict) and path else
                              (str(k) if isinstance(node, dict) else f"{path}[{k}]"), False))
    return _child_size(obj, sizes)


def _child_size(v: Any, sizes: dict[int, int]) -> int:
    return _leaf_size(v) if isinstance(v, _LEAF) else sizes[id(v)]


def check_json_size(obj: Any, limit_bytes: float, what: str, where: str = "") -> int:
    """`json_size(obj)` if it is at most `limit_bytes`; otherwise StateError naming the smallest part of `obj`
    that alone exceeds the limit (the key to look at), `what` being the file or value it would become."""
    try:
        return json_size(obj, limit_bytes, where)
    except StateError as e:
        if "above the limit" not in e.why:
            raise
        key = re.sub(r"(\[\d+\])+$", "", e.where)  # the key, not the position inside its nested lists
        raise StateError(key, f"{e.why}, so {what} would be too big") from None


def read_json(path: str | Path, limit_bytes: int) -> Any:
    """The JSON data in file `path`; StateError (naming the file) when it is bigger than `limit_bytes`, not UTF-8,
    not JSON, or nested too deeply to parse."""
    path = Path(path)
    size = path.stat().st_size
    if size > limit_bytes:
        raise StateError(str(path), f"{size / 2**20:.1f} MB, above the limit of {limit_bytes / 2**20:.1f} MB for "
                                    f"this file; refused unread")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise StateError(str(path), f"not UTF-8 text ({e})") from None
    except RecursionError:
        raise StateError(str(path), "nested too deeply to parse") from None
    except ValueError as e:  # JSONDecodeError, or an integer literal of more digits than Python converts
        raise StateError(str(path), f"not valid JSON ({e})") from None
