"""Typed config machinery: dataclass trees built from YAML plus dotted command-line overrides.

    cfg = load_config(PPOConfig, "job.yaml", ["actor.optim.lr=1e-6", "rollout.n=4"])

Every config class is a `@dataclass(kw_only=True, slots=True)` whose fields carry a docstring (a string
literal right after the field, read back with `field_docs`). Unknown keys — in the YAML or in an override —
raise `VerlConfigError` naming the full dotted key and its nearest valid spelling; values are checked
against the field's type (int, float, bool, str, Literal choices, optional, lists, nested configs). A section
given a scalar, a key written twice in one YAML mapping and a NaN are errors too.

Ranges: a numeric field declares its bounds in its annotation, `n: Annotated[int, Range(1, 1 << 16)] = 8`
(shown in --help); an int field without one is held to 32 bits (`INT_RANGE`), so no huge integer reaches torch
as an overflow naming no key. Bounds are checked on load, before the class's own `check()`, which holds the
rules between fields and raises `ConfigValueError(key, why)`; `from_dict` puts the section's dotted path in
front of the key, so one OptimConfig under `actor.optim` and `critic.optim` names the right one.

Sizes (`LIMITS`): a config file must be UTF-8 (or UTF-16/32 with a byte-order mark) text of at most
`max_file_bytes`, nested at most `max_depth` deep, and no key's value may expand (YAML anchors and aliases are
expanded by everything that later copies or saves the config) to more than `max_values` values; each is a
VerlConfigError naming the file or the key. `VERL_CONFIG_MAX_VALUES` raises the last for a legitimately large
config.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import os
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from verl.errors import VerlConfigError

T = TypeVar("T")


class ConfigValueError(VerlConfigError):
    """A bad value of one key, raised by a config class's `check()`; `key` is relative to the class."""

    def __init__(self, key: str, detail: str):
        self.key, self.detail = key, detail
        super().__init__(f"config key '{key}': {detail}")


def require(ok: bool, key: str, value: Any, want: str) -> None:
    """Raises ConfigValueError(key, "<value> <want>") unless `ok` (NaN fails every comparison, so a range check
    written as `ok = low <= value <= high` rejects NaN too)."""
    if not ok:
        raise ConfigValueError(key, f"{value!r} {want}")


@dataclass(frozen=True, slots=True)
class Range:
    """Bounds of a numeric config field (both inclusive; None: unbounded on that side), declared in the field's
    annotation: `n: Annotated[int, Range(1, 1 << 16)] = 8`. On a list field it bounds every item."""

    low: float | None = None
    high: float | None = None

    def violation(self, value: Any) -> str | None:
        """Why `value` is out of range, or None (bools, strings and None are not judged here)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        if self.low is not None and not value >= self.low:  # written so that NaN fails
            return f"must be >= {self.low}" + self._span()
        if self.high is not None and not value <= self.high:
            return f"must be <= {self.high}" + self._span()
        return None

    def _span(self) -> str:
        return f" (range [{self.low}, {self.high}])" if self.low is not None and self.high is not None else ""

    def __str__(self) -> str:
        return f"[{'-inf' if self.low is None else self.low}, {'inf' if self.high is None else self.high}]"


INT_RANGE = Range(-(1 << 31), (1 << 31) - 1)
"""The bounds of an int field that declares none: every count, size, seed and rank a job uses fits in 32 bits,
and larger values would end as overflows inside torch that name no key."""


@functools.cache
def ranges(cls: type) -> dict[str, Range]:
    """Field name → its declared Range (INT_RANGE for an int field, or a list of ints, that declares none)."""
    out = {}
    for name, tp in typing.get_type_hints(cls, include_extras=True).items():
        declared = [m for m in getattr(tp, "__metadata__", ()) if isinstance(m, Range)]
        if declared:
            out[name] = declared[0]
        elif _int_like(_hints(cls)[name]):
            out[name] = INT_RANGE
    return out


def _int_like(tp: Any) -> bool:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if tp is int:
        return True
    if typing.get_origin(tp) in (Union, types.UnionType, list, tuple):
        return any(_int_like(a) for a in args)
    return False


def check_ranges(cfg: Any) -> None:
    """Every field of the config object `cfg` within its Range (see `ranges`); raises ConfigValueError."""
    for name, rng in ranges(type(cfg)).items():
        value = getattr(cfg, name)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            why = rng.violation(v)
            if why is not None:
                raise ConfigValueError(name, f"{v!r} {why}")


def check_finite(cfg: Any, allow_inf: tuple[str, ...] = ()) -> None:
    """Every float field (and float list) of the config object `cfg` is finite, except ±inf in `allow_inf`."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        items = value if isinstance(value, (list, tuple)) else [value]
        for v in items:
            if isinstance(v, float) and not math.isfinite(v) and not (f.name in allow_inf and math.isinf(v)):
                raise ConfigValueError(f.name, f"{value!r} is not a finite number; give a finite value")


def _suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"{hint}valid keys: {', '.join(sorted(valid))}"


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _dataclass_type(tp: Any) -> type | None:
    """The config class inside `tp` (also through `Optional[...]`), or None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            return inner[0]
    return None


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Checks (and for strings from the command line, converts) `value` against the field type `tp`."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return _coerce_union(value, tp, key)
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool):  # YAML 1.1 reads off / on / no / yes as booleans: the choice spelled so
            spelled = ("on", "yes", "true") if value else ("off", "no", "false")
            value = next((c for c in choices if c in spelled), value)
        if value in choices:
            return value
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.4)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise VerlConfigError(f"config key '{key}': {value!r} is not one of {', '.join(map(repr, choices))}{hint}")
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v] if value else []
        if not isinstance(value, (list, tuple)):
            raise VerlConfigError(f"config key '{key}': expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise VerlConfigError(f"config key '{key}': expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):  # a config inside a list (e.g. reward.sources[i])
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise VerlConfigError(f"config key '{key}': expected a mapping of {tp.__name__} keys, got {value!r}")
        return from_dict(tp, value, f"{key}.")
    scalar = _SCALARS.get(tp)
    return value if scalar is None else scalar(value, key)


def _coerce_union(value: Any, tp: Any, key: str) -> Any:
    args = typing.get_args(tp)
    if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
        return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _coerce(value, arg, key)
        except VerlConfigError as e:
            errors.append(str(e))
    raise VerlConfigError(f"config key '{key}': {value!r} does not match {tp}; " + "; ".join(errors))


def _to_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise VerlConfigError(f"config key '{key}': expected true/false, got {value!r}")


def _to_int(value: Any, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise VerlConfigError(f"config key '{key}': expected an integer, got {value!r}")


def _to_float(value: Any, key: str) -> float:
    out = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        out = float(value)
    elif isinstance(value, str):
        try:  # YAML 1.1 reads `1e-6` (no dot) as a string
            out = float(value)
        except ValueError:
            pass
    if out is None:
        raise VerlConfigError(f"config key '{key}': expected a number, got {value!r}")
    if math.isnan(out):  # no setting means "not a number"; infinities are judged by each class's check()
        raise VerlConfigError(f"config key '{key}': NaN is not a valid setting; give a number")
    return out


def _to_str(value: Any, key: str) -> str:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        if isinstance(value, str) and "\x00" in value:  # no path, name or text setting has a use for NUL
            raise VerlConfigError(f"config key '{key}': {value!r} contains a NUL character; remove it")
        return str(value)
    raise VerlConfigError(f"config key '{key}': expected a string, got {value!r}")


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def from_dict(cls: type[T], data: dict | None, prefix: str = "") -> T:
    """Builds the config `cls` from a nested mapping; unknown keys and ill-typed values are errors."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise VerlConfigError(f"config section '{prefix or '<root>'}' must be a mapping, got {data!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    hints = _hints(cls)
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            raise VerlConfigError(f"unknown config key '{full}' in {cls.__name__}; {_suggest(str(key), names)}")
        sub = _dataclass_type(hints[key])
        if sub is None:
            kwargs[key] = _coerce(value, hints[key], full)
        elif isinstance(value, dict):
            kwargs[key] = from_dict(sub, value, f"{full}.")
        elif value is None:  # `section:` with nothing under it: None if the field allows it, else the defaults
            kwargs[key] = None if _allows_none(hints[key]) else from_dict(sub, {}, f"{full}.")
        else:
            raise VerlConfigError(f"config key '{full}' is a section ({sub.__name__}), not a value: got {value!r}; "
                                  f"{_section_hint(sub, full, value)}")
    try:
        obj = cls(**kwargs)
        check_ranges(obj)
        check = getattr(obj, "check", None)
        if callable(check):
            check()
    except TypeError as e:
        raise VerlConfigError(f"config section '{prefix or '<root>'}': {e}") from e
    except ConfigValueError as e:
        if not prefix:
            raise
        raise ConfigValueError(prefix + e.key, e.detail) from None
    return obj


def _section_hint(cls: type, full: str, value: Any) -> str:
    """What the user of `section: value` probably meant: the key whose choices or default is `value`, or `path`."""
    hints, defaults = _hints(cls), cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if (typing.get_origin(tp) is Literal and value in typing.get_args(tp)) or getattr(defaults, f.name) == value:
            return f"did you mean '{full}.{f.name}={value}'?"
    names = [f.name for f in dataclasses.fields(cls)]
    if "path" in names and isinstance(value, str):
        return f"did you mean '{full}.path={value}'?"
    return f"set its keys instead, e.g. '{full}.<key>=...' (keys: {', '.join(names)})"


def _allows_none(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp)


def to_dict(cfg: Any) -> Any:
    """The plain nested dict (YAML-ready) of a config tree."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    return cfg


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key written twice in one mapping (PyYAML keeps the last one without a word)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in seen:
                raise VerlConfigError(f"config key '{key}' is written twice in one mapping (lines {seen[key]} and "
                                      f"{line}); keep one of them")
            if isinstance(key, typing.Hashable):
                seen[key] = line
        return super().construct_mapping(node, deep)


def _safe_load(stream) -> Any:
    return yaml.load(stream, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise VerlConfigError(f"override {item!r} must look like 'section.key=value' (e.g. actor.optim.lr=1e-6)")
    key, raw = item.split("=", 1)
    key = key.strip().lstrip("+")
    if not key:
        raise VerlConfigError(f"override {item!r} has an empty key")
    try:
        value = _safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    except RecursionError:
        raise VerlConfigError(f"override of '{key}' is nested too deeply to read; flatten it") from None
    check_size({key: value}, "(command-line override)")
    return key.split("."), value


def _check_path(cls: type, path: list[str]) -> None:
    """Raises naming the first unknown component of a dotted override key."""
    cur = cls
    for i, part in enumerate(path):
        names = [f.name for f in dataclasses.fields(cur)]
        if part not in names:
            where = ".".join(path[:i]) or "<root>"
            raise VerlConfigError(f"unknown config key '{'.'.join(path)}' ('{part}' is not a key of {where}); "
                                  f"{_suggest(part, names)}")
        tp = _hints(cur)[part]
        sub = _dataclass_type(tp)
        if i < len(path) - 1:
            if sub is None and (tp is dict or typing.get_origin(tp) is dict):
                return  # a free-form mapping (e.g. actor.policy_loss_params): its owner checks the keys
            if sub is None:
                raise VerlConfigError(f"config key '{'.'.join(path[:i + 1])}' is a value, not a section; "
                                      f"it has no key '{path[i + 1]}'")
            cur = sub


def _section_at(cls: type, path: list[str]) -> type | None:
    """The config class at the dotted `path` below `cls` (None where it is a free-form mapping)."""
    for part in path:
        cls = _dataclass_type(_hints(cls)[part]) if cls is not None else None
    return cls


def apply_overrides(cls: type, data: dict, overrides: list[str]) -> dict:
    """Returns a copy of the raw mapping `data` with dotted `key=value` overrides applied (validated)."""
    import copy
    out = copy.deepcopy(data) if data else {}
    for item in overrides:
        path, value = _parse_override(item)
        _check_path(cls, path)
        node = out
        for i, part in enumerate(path[:-1]):
            if node.get(part) is None:  # absent, or `section:` with nothing under it
                node[part] = {}
            elif not isinstance(node[part], dict):  # replacing it would drop the value without a word
                full = ".".join(path[:i + 1])
                sub = _section_at(cls, path[:i + 1])
                hint = _section_hint(sub, full, node[part]) if sub is not None else "write it as a mapping"
                raise VerlConfigError(f"config key '{full}' is a section, but the config file gives it the value "
                                      f"{node[part]!r} (and override {item!r} sets a key under it); {hint}")
            node = node[part]
        node[path[-1]] = value
    return out


@dataclass(frozen=True, slots=True)
class ConfigLimits:
    """How large a config may be (see the module docstring); `LIMITS` holds the ones load_config applies."""

    max_file_bytes: int = 16 << 20
    """Largest config file read."""
    max_depth: int = 32
    """Deepest nesting of mappings and lists (the job's own tree is 4 deep)."""
    max_values: int = 100_000
    """Most values (scalars, mappings, lists) one key's value may expand to, YAML aliases expanded."""


def _limits_from_env() -> ConfigLimits:
    raw = os.environ.get("VERL_CONFIG_MAX_VALUES")
    if raw is None:
        return ConfigLimits()
    if not raw.isdigit() or int(raw) < 1:
        raise VerlConfigError(f"VERL_CONFIG_MAX_VALUES={raw!r} must be a positive integer")
    return ConfigLimits(max_values=int(raw))


def check_size(data: Any, where: str, limits: ConfigLimits | None = None) -> None:
    """Raises VerlConfigError naming the key (under `where`) whose value nests deeper than limits.max_depth,
    refers to itself, or expands to more than limits.max_values values. Shared (aliased) values are measured
    once and counted at every place they appear, so an alias bomb costs the check no more than its text."""
    limits = limits or _limits_from_env()
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(v: Any, path: str, depth: int) -> int:
        if not isinstance(v, (dict, list)):
            return 1
        if id(v) in sizes:
            return sizes[id(v)]
        if id(v) in open_:
            raise VerlConfigError(f"config key '{path}' {where} contains itself (a YAML alias to an enclosing "
                                  f"anchor); write the value out")
        if depth >= limits.max_depth:
            raise VerlConfigError(f"config key '{path}' {where} is nested more than {limits.max_depth} levels deep; "
                                  f"flatten it")
        open_.add(id(v))
        items = v.items() if isinstance(v, dict) else enumerate(v)
        total = 1
        for k, child in items:
            total += size(child, f"{path}.{k}" if isinstance(v, dict) else f"{path}[{k}]", depth + 1)
        open_.discard(id(v))
        if total > limits.max_values:  # the innermost value too large on its own (its parts were measured first)
            raise VerlConfigError(f"config key '{path}' {where} expands to more than {limits.max_values} values "
                                  f"(YAML anchors and aliases are expanded); shrink it, or raise the limit with "
                                  f"VERL_CONFIG_MAX_VALUES")
        sizes[id(v)] = total
        return total

    for key, value in (data.items() if isinstance(data, dict) else [("<root>", data)]):
        size(value, str(key), 1)


def _decode(raw: bytes, p: Path) -> str:
    """The text of a config file: UTF-8 (a BOM allowed), or UTF-16 / UTF-32 announced by their BOM."""
    import codecs
    for bom, enc in ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
                     (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16")):
        if raw.startswith(bom):
            try:
                return raw.decode(enc)
            except UnicodeDecodeError as e:
                raise VerlConfigError(f"config file {str(p)!r} starts with a {enc.upper()} byte-order mark but is "
                                      f"not {enc.upper()} text ({e.reason} at byte {e.start}); save it as "
                                      f"UTF-8") from None
    if b"\x00" in raw:
        raise VerlConfigError(f"config file {str(p)!r} is not a text file (it holds NUL bytes); pass a YAML file")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise VerlConfigError(f"config file {str(p)!r} is not UTF-8 text (byte 0x{raw[e.start]:02x} on line {line} "
                              f"cannot be decoded: {e.reason}); save it as UTF-8") from None


def load_yaml(path: str | Path) -> dict:
    """The mapping a YAML config file holds; every way the file can be unreadable is a VerlConfigError naming it."""
    p = Path(path)
    limits = _limits_from_env()
    if p.is_dir():
        raise VerlConfigError(f"config file {str(p)!r} is a directory; pass a YAML file inside it "
                              f"(e.g. verl/trainer/config/default.yaml)")
    if not p.is_file():
        raise VerlConfigError(f"config file {str(p)!r} does not exist; pass a YAML file "
                              f"(e.g. verl/trainer/config/default.yaml)")
    try:
        if p.stat().st_size > limits.max_file_bytes:
            raise VerlConfigError(f"config file {str(p)!r} is {p.stat().st_size} bytes, more than a config's "
                                  f"{limits.max_file_bytes}; pass the YAML config, not a data file")
        text = _decode(p.read_bytes(), p)
    except OSError as e:
        raise VerlConfigError(f"config file {str(p)!r} cannot be read: {e.strerror or e}") from e
    try:
        data = _safe_load(text)
    except yaml.YAMLError as e:
        raise VerlConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from e
    except VerlConfigError as e:
        raise VerlConfigError(f"config file {str(p)!r}: {e}") from None
    except RecursionError:
        raise VerlConfigError(f"config file {str(p)!r} is nested too deeply to read (more than "
                              f"{limits.max_depth} levels are refused anyway); flatten it") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise VerlConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
    check_size(data, f"in {str(p)!r}", limits)
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """YAML file (optional) + dotted overrides → a validated config tree of type `cls`."""
    data = load_yaml(path) if path is not None else {}
    data = apply_overrides(cls, data, list(overrides or []))
    check_size(data, "(file and overrides together)")
    return from_dict(cls, data)


def field_docs(cls: type) -> dict[str, str]:
    """Field name → its docstring (the string literal written right after the field in the class body)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe(cls: type, prefix: str = "") -> list[str]:
    """Lines `key = default [in range]: doc` for every field of the tree — the `--help` of a config."""
    lines = []
    docs = field_docs(cls)
    hints = _hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        sub = _dataclass_type(hints[f.name])
        if sub is not None:
            lines.append(f"{prefix}{f.name}: {docs.get(f.name, '')}")
            lines.extend(describe(sub, f"{prefix}{f.name}."))
        else:
            default = getattr(defaults, f.name)
            rng = ranges(cls).get(f.name)
            shown = f" in {rng}" if rng is not None and rng is not INT_RANGE else ""
            lines.append(f"{prefix}{f.name} = {default!r}{shown}: {docs.get(f.name, '')}")
            item = typing.get_args(hints[f.name])[:1] if typing.get_origin(hints[f.name]) is list else ()
            if item and dataclasses.is_dataclass(item[0]):  # the keys of each entry of a list of configs
                lines.extend(describe(item[0], f"{prefix}{f.name}[]."))
    return lines
