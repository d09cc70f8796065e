"""Results write their own docs: docs/benchmarks.md and the figures README.md quotes are what
scripts/render_results.py renders from benchmarks/results/*.json, and every results file says how it was made."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("render_results", ROOT / "scripts" / "render_results.py")
render = importlib.util.module_from_spec(spec)
spec.loader.exec_module(render)


def test_docs_benchmarks_md_is_what_the_script_renders():
    want = render.render_doc(render.load())
    got = (ROOT / "docs" / "benchmarks.md").read_text()
    assert got == want, "docs/benchmarks.md differs from the results: run python scripts/render_results.py"


def test_readme_figures_are_rendered():
    text = (ROOT / "README.md").read_text()
    spans = render.SPAN.findall(text)
    assert {name for name, _ in spans} == set(render.FIGURES), "a README figure span without a renderer, or back"
    assert render.render_readme(text, render.load()) == text, \
        "a README figure differs from the results: run python scripts/render_results.py"


def test_every_result_says_how_it_was_made():
    """One reproducible command, the commit and the machine's load (verl.utils.results), unless the file is
    listed as written before the benchmarks recorded them, with what is missing."""
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        data = json.loads(path.read_text())
        if "traceEvents" in data or path.name in render.LEGACY or path.name in render.PRE_PROVENANCE:
            continue
        meta = data.get("meta", {})
        assert isinstance(meta.get("command"), str) and "python " in meta["command"], path.name
        assert meta.get("commit") and "load_avg_1m" in meta and meta.get("date_utc"), path.name


def test_a_changed_result_changes_the_doc(tmp_path):
    results = render.load()
    name = "bench_trl_kernels.json"
    changed = json.loads(json.dumps(results[name]))
    changed["ratios_verl_vs_trl"]["update_cpu_s"] = 0.4321
    assert render.render_doc({**results, name: changed}) != render.render_doc(results)
    assert "takes 0.43x TRL's CPU time" in render.FIGURES["trl_kernels"]({**results, name: changed})
