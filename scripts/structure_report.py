#!/usr/bin/env python3
"""Structure counts of the `verl` package, for keeping the layout small enough to hold in one's head.

    python scripts/structure_report.py            # a table
    python scripts/structure_report.py --json     # the same as JSON

Counts: Python modules; config classes (dataclasses named *Config); functions longer than 60 lines (Python by
AST, C++/CUDA by brace matching); placement types (classes that describe where a process sits: the names in
PLACEMENT_TYPES that exist); imports that go up a layer or form a cycle between modules. The layers are those
of docs/ARCHITECTURE.md, lowest first. Duplicated blocks are counted by the `duplicates` tool where present.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "verl"

# Lowest layer first; a module may import its own layer or lower ones. Modules not listed are layer-neutral
# (errors, the package roots, the command line).
LAYERS = [
    ("ops", ("verl.ops", "verl._extension", "verl.errors", "verl.registry", "verl.algos")),
    ("models", ("verl.models", "verl.engines", "verl.agents", "verl.distributed", "verl.rollout", "verl.hybrid_engine",
                "verl.utils", "verl.config", "verl.data", "verl.rewards", "verl.testing")),
    ("workers", ("verl.workers",)),
    ("trainer", ("verl.trainer", "verl.dataflow", "verl.debug", "verl.cli")),
]
PLACEMENT_TYPES = ("World", "ProcessGroups", "TrainingLayout", "NodeContext", "Placement", "ParallelDims")  # before / after


def modname(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(mod: str) -> int | None:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if mod == p or mod.startswith(p + "."):
                if best is None or len(p) > best[1]:
                    best = (i, len(p))
    return None if best is None else best[0]


def module_imports(path: Path, mods: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    me = modname(path)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")
                up = up[:len(up) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for n in names:
            while n and n not in mods:
                n = n.rpartition(".")[0]
            if n and n != me and n.startswith("verl"):
                out.add(n)
    return out


def python_long_functions(files: list[Path], limit: int) -> list[str]:
    out = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    return out


def cpp_long_functions(files: list[Path], limit: int) -> list[str]:
    """Top-level brace blocks (namespaces are transparent) whose header looks like a function."""
    out = []
    for f in files:
        text = f.read_text()
        text = re.sub(r"namespace\s+[\w:]*\s*\{", "", text)
        lines = text.splitlines()
        depth, start, header = 0, None, ""
        for i, line in enumerate(lines):
            code = re.sub(r"//.*", "", line)
            if depth == 0 and start is None and "{" in code:
                head = " ".join(lines[max(0, i - 3):i + 1])
                if not re.search(r"\b(struct|class|enum|TORCH_LIBRARY\w*)\b", code) and "(" in head:
                    start, header = i, head
            depth = max(0, depth + code.count("{") - code.count("}"))
            if depth == 0 and start is not None:
                n = i - start + 1
                if n > limit:
                    m = re.findall(r"([A-Za-z_]\w*)\s*\(", header)
                    out.append(f"{f.relative_to(ROOT)}:~{start + 1} {m[-1] if m else '?'} ({n} lines)")
                start = None
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def report() -> dict:
    files = sorted(p for p in PKG.rglob("*.py"))
    mods = {modname(p) for p in files}
    graph = {modname(p): module_imports(p, mods) for p in files}
    # a package's __init__ re-exporting its submodules is not an edge worth counting as a cycle
    strict = {m: {d for d in deps if not (m.startswith(d + ".") and d in mods)} for m, deps in graph.items()}
    upward = []
    for m, deps in graph.items():
        lm = layer_of(m)
        for d in deps:
            ld = layer_of(d)
            if lm is not None and ld is not None and ld > lm:
                upward.append(f"{m} -> {d} ({LAYERS[lm][0]} imports {LAYERS[ld][0]})")
    configs = []
    placement = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef):
                if node.name.endswith("Config"):
                    configs.append(f"{modname(f)}.{node.name}")
                if node.name in PLACEMENT_TYPES:
                    placement.append(f"{modname(f)}.{node.name}")
    cpp = sorted((ROOT / "csrc").rglob("*.cpp")) + sorted((ROOT / "csrc").rglob("*.cu")) + \
        sorted((ROOT / "csrc").rglob("*.h"))
    long_py = python_long_functions(files, 60)
    long_cpp = cpp_long_functions(cpp, 60)
    dup = None
    if shutil.which("duplicates"):
        res = subprocess.run(["duplicates", "--most", "200", "--seconds", "60"], cwd=ROOT, capture_output=True,
                             text=True)
        rows = [line for line in res.stdout.splitlines() if line.startswith("D")]
        dup = {"pairs": len(rows), "identical": sum(1 for r in rows if " shape" not in r),
               "summary": res.stdout.splitlines()[0] if res.stdout else ""}
    return {"modules": len(files), "python_lines": sum(len(f.read_text().splitlines()) for f in files),
            "cpp_lines": sum(len(f.read_text().splitlines()) for f in cpp),
            "config_classes": configs, "long_functions": long_py + long_cpp, "placement_types": placement,
            "upward_imports": sorted(upward), "import_cycles": cycles(strict), "duplicates": dup}


def main() -> int:
    r = report()
    if "--json" in sys.argv:
        print(json.dumps(r, indent=1))
        return 0
    print(f"modules                {r['modules']}  ({r['python_lines']} Python lines, {r['cpp_lines']} C++/CUDA)")
    print(f"config classes         {len(r['config_classes'])}: {', '.join(c.rpartition('.')[2] for c in r['config_classes'])}")
    print(f"functions > 60 lines   {len(r['long_functions'])}")
    for f in r["long_functions"]:
        print(f"    {f}")
    print(f"placement types        {len(r['placement_types'])}: {', '.join(r['placement_types'])}")
    print(f"upward imports         {len(r['upward_imports'])}")
    for u in r["upward_imports"]:
        print(f"    {u}")
    print(f"import cycles          {len(r['import_cycles'])}")
    for c in r["import_cycles"]:
        print(f"    {' <-> '.join(c)}")
    if r["duplicates"] is not None:
        print(f"duplicated 6+-line     {r['duplicates']['pairs']} pairs ({r['duplicates']['identical']} identical, "
              f"the rest alike in shape)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
