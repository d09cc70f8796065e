"""`verl compat`: what a launch script or config of upstream verl becomes here, before anything runs.

    verl compat run_qwen2-7b.sh [key=value ...]   # each `python3 -m verl.trainer.main_ppo ...` line of the script,
                                                  # with the extra arguments standing in for its "$@"
    verl compat config.yaml [key=value ...]       # a verl YAML (Hydra keys), plus overrides
    verl compat -- key=value ...                  # a command line of overrides alone
    verl compat --keys [--json]                   # the translation table: every verl key pattern and its rule

For each command line: the verl keys it sets (mapped onto ours, ignored with the reason, refused with the reason),
the keys of verl's defaults whose value changed ours, notes, and the resulting config as YAML (the keys that differ
from this verl's defaults). Exit code 0 when nothing is refused, 2 otherwise.

Scripts are read, never run: shell variables set in the script (`NAME=value`, `export NAME=value`, `${NAME:-default}`,
`$((arithmetic))`) and the environment are substituted; a variable with no value (or set by a command
substitution) is named as a problem. `if` blocks are not evaluated (their assignments count as run).
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from verl.errors import VerlConfigError

ENTRY = "verl.trainer.main_ppo"


@dataclass
class Invocation:
    """One `... -m verl.trainer.main_ppo ARGS` line of a launch script."""

    line: int
    argv: list[str]
    problems: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- shell reading

_ASSIGN = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.floordiv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def _arith(expr: str, env: dict, problems: list[str]) -> str:
    """bash's $((expr)) on integers (+ - * / %, parentheses, variables)."""
    text = re.sub(r"\$?\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: str(env.get(m.group(1), "0")), expr)

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(expr)
    try:
        return str(ev(ast.parse(text, mode="eval")))
    except (ValueError, SyntaxError, ZeroDivisionError):
        problems.append(f"$(({expr})) is not integer arithmetic this reader evaluates")
        return ""


def _expand(text: str, env: dict, extra: list[str], problems: list[str]) -> str:
    """`text` with its variables substituted, quotes kept (the values escaped so that shlex reads them whole
    inside double quotes, and split on spaces outside, as bash does)."""
    out, i, quote = [], 0, None
    while i < len(text):
        c = text[i]
        if c == "\\" and quote != "'" and i + 1 < len(text):
            out.append(text[i:i + 2])
            i += 2
            continue
        if c in "'\"" and quote in (None, c):
            quote = None if quote == c else c
            out.append(c)
            i += 1
            continue
        if c == "$" and quote != "'":
            value, i = _variable(text, i, env, extra, problems, quote)
            out.append(value)
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _escape(value: str, quote) -> str:
    if quote == '"':
        return value.replace("\\", "\\\\").replace('"', '\\"')
    return re.sub(r"([\\'\"])", r"\\\1", value)


def _variable(text: str, i: int, env: dict, extra: list[str], problems: list[str], quote) -> tuple[str, int]:
    """The expansion of the `$...` at text[i] and the index after it."""
    rest = text[i + 1:]
    if rest.startswith("(("):
        end = rest.find("))")
        return _arith(rest[2:end], env, problems), i + 1 + end + 2
    if rest.startswith("("):
        end = rest.find(")")
        problems.append(f"$({rest[1:end]}) is a command substitution; this reader does not run commands")
        return "", i + 1 + end + 1
    if rest[:1] in ("@", "*"):
        return " ".join(shlex.quote(a) for a in extra), i + 2
    if rest.startswith("{"):
        end = _closing_brace(rest)
        name, sep, default = re.match(r"([A-Za-z_][A-Za-z0-9_]*)(:?-)?(.*)", rest[1:end], re.S).groups()
        length = end + 1
    else:
        m = re.match(r"[A-Za-z_][A-Za-z0-9_]*", rest)
        if not m:
            return "$", i + 1
        name, sep, default, length = m.group(0), None, "", m.end()
    if name in _TAINTED.get(id(env), {}):
        problems.append(f"${name}: {_TAINTED[id(env)][name]}")
    if name in env and (env[name] or sep != ":-"):
        value = env[name]
    elif sep:
        value = _unquote(_expand(default, env, extra, problems))
    else:
        problems.append(f"${name} has no value (not set in the script nor in the environment)")
        value = ""
    return _escape(value, quote), i + 1 + length


_TAINTED: dict[int, dict[str, str]] = {}
"""Per environment being read (by id): variables whose value this reader could not work out, and why."""


def _closing_brace(text: str) -> int:
    depth = 0
    for j, c in enumerate(text):
        depth += {"{": 1, "}": -1}.get(c, 0)
        if depth == 0:
            return j
    return len(text) - 1


def _unquote(text: str) -> str:
    words = shlex.split(text) if text.strip() else [""]
    return " ".join(words)


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, line) with backslash-newline continuations joined, as bash reads them."""
    out, buf, start = [], "", None
    for n, line in enumerate(text.split("\n"), 1):
        start = n if start is None else start
        if line.endswith("\\") and not line.endswith("\\\\"):
            buf += line[:-1]
            continue
        out.append((start, buf + line))
        buf, start = "", None
    if buf:
        out.append((start, buf))
    return out


def read_script(path: Path, extra: list[str], environ: dict | None = None) -> list[Invocation]:
    """The `verl.trainer.main_ppo` command lines of a bash launch script, its variables substituted."""
    env = dict(os.environ if environ is None else environ)
    tainted = _TAINTED.setdefault(id(env), {})
    try:
        return _read(path, env, tainted, extra)
    finally:
        _TAINTED.pop(id(env), None)


def _read(path: Path, env: dict, tainted: dict, extra: list[str]) -> list[Invocation]:
    found: list[Invocation] = []
    for lineno, line in _logical_lines(path.read_text()):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        problems: list[str] = []
        m = _ASSIGN.match(line)
        if m and ENTRY not in line:
            words = shlex.split(_expand(m.group(2), env, extra, problems), comments=True) or [""]
            env[m.group(1)] = words[0]
            if problems:
                tainted[m.group(1)] = "; ".join(problems)
            continue
        if ENTRY not in line:
            continue
        words = shlex.split(_expand(line, env, extra, problems), comments=True)
        argv = words[words.index(ENTRY) + 1:] if ENTRY in words else []
        found.append(Invocation(lineno, argv, problems))
    if not found:
        raise VerlConfigError(f"{path}: no `python3 -m {ENTRY} ...` line found")
    return found


# ---------------------------------------------------------------------------------------------- report

def _show(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def report(argv: list[str], out=None, show_defaults: bool = False) -> int:
    """Prints what the command line `argv` (main_ppo's arguments) becomes; returns the number of refusals."""
    out = out or sys.stdout
    from verl.config.base import to_dict
    from verl.config.ppo import PPOConfig
    from verl.config.verl_dialect import load_job, split_hydra, translate
    from verl.trainer.main_ppo import DEFAULT_CONFIG
    hydra, rest = split_hydra(argv)
    try:
        cfg, t = load_job(argv, DEFAULT_CONFIG)
    except VerlConfigError as e:
        t = None
        if "cannot be expressed here" not in str(e):
            print(f"  config error: {e}", file=out)
            return 1
        yaml_given = rest and "=" not in rest[0]
        t = translate(rest[1:] if yaml_given else rest, None if yaml_given else None,
                      megatron="megatron" in hydra.get("name", ""))
        cfg = None
        error = e
    if t is None:
        print("  no verl keys: read as this verl's own dialect", file=out)
    else:
        _entries(t, out, show_defaults)
    if cfg is not None:
        print("translated config (keys that differ from this verl's defaults):", file=out)
        for line in _diff(to_dict(cfg), to_dict(PPOConfig())):
            print(f"  {line}", file=out)
    elif t is not None:
        print(f"not runnable: {error}", file=out)
    return len(t.refused) if t is not None else 0


def _entries(t, out, show_defaults: bool) -> None:
    given = [e for e in t.entries if e.given]
    groups = {"map": "mapped", "native": "keys of this dialect", "ignore": "accepted, no effect here",
              "refuse": "REFUSED"}
    for kind, title in groups.items():
        rows = [e for e in given if e.kind == kind] if kind != "refuse" else [e for e in t.entries
                                                                              if e.kind == "refuse"]
        if not rows:
            continue
        print(f"{title} ({len(rows)}):", file=out)
        for e in rows:
            arrow = "->" if kind in ("map", "native") else "--"
            print(f"  {e.key}={_show(e.value)}  {arrow} {e.detail}", file=out)
    defaulted = [e for e in t.entries if not e.given and e.kind == "map"]
    print(f"verl defaults applied: {len(defaulted)} keys mapped, "
          f"{sum(1 for e in t.entries if not e.given and e.kind == 'ignore')} without effect here"
          + ("" if show_defaults else " (--all lists them)"), file=out)
    if show_defaults:
        for e in defaulted:
            print(f"  {e.key}={_show(e.value)}  -> {e.detail}", file=out)
    print(f"processes: trainer.n_gpus_per_node x nnodes = {t.world}", file=out)
    for note in t.notes:
        print(f"note: {note}", file=out)


def _diff(ours: dict, base: dict, prefix: str = "") -> list[str]:
    lines = []
    for k, v in ours.items():
        b = base.get(k) if isinstance(base, dict) else None
        if isinstance(v, dict) and isinstance(b, dict):
            lines += _diff(v, b, f"{prefix}{k}.")
        elif v != b:
            lines.append(f"{prefix}{k}: {json.dumps(v)}")
    return lines


def keys_table(as_json: bool, out=None) -> None:
    """The translation table, one rule per line: pattern, kind, what it does or why."""
    out = out or sys.stdout
    from verl.config.verl_dialect import TABLE
    seen = set()
    rows = []
    for rule in TABLE:
        if rule.pattern in seen:
            continue
        seen.add(rule.pattern)
        rows.append({"key": rule.pattern, "kind": rule.kind, "what": rule.why})
    if as_json:
        print(json.dumps(rows, indent=1), file=out)
        return
    for r in rows:
        print(f"{r['kind']:<7} {r['key']}: {r['what']}", file=out)
    counts = {k: sum(1 for r in rows if r["kind"] == k) for k in ("map", "refuse", "ignore")}
    print(f"\n{len(rows)} patterns: {counts['map']} map, {counts['refuse']} refuse (accepted at the values where "
          f"they have no effect), {counts['ignore']} ignore (no effect here)", file=out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="verl compat", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", nargs="?", help="a launch script (.sh), a verl YAML, or -- before overrides")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="key=value overrides (a script's \"$@\")")
    parser.add_argument("--keys", action="store_true", help="print the translation table")
    parser.add_argument("--json", action="store_true", help="with --keys: as JSON")
    parser.add_argument("--all", action="store_true", help="also list the verl defaults that were applied")
    args = parser.parse_args(argv)
    if args.keys:
        keys_table(args.json)
        return 0
    if args.source is None:
        parser.print_help()
        return 2
    refused = 0
    if args.source.endswith(".sh"):
        if not Path(args.source).is_file():
            print(f"verl compat: {args.source}: no such launch script (give the path of a bash script that runs "
                  f"python3 -m {ENTRY})", file=sys.stderr)
            return 2
        for inv in read_script(Path(args.source), args.args):
            print(f"== {args.source}, line {inv.line}: python3 -m {ENTRY} ({len(inv.argv)} arguments)")
            for p in inv.problems:
                print(f"problem: {p}")
            refused += report(inv.argv, show_defaults=args.all) + len(inv.problems)
    else:
        argv = args.args if args.source == "--" else [args.source, *args.args]
        refused = report(argv, show_defaults=args.all)
    return 0 if refused == 0 else 2
