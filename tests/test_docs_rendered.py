"""Results write their own docs: docs/benchmarks.md and the figures README.md and the docs pages quote are what
scripts/render_results.py renders from benchmarks/results/*.json, every results file says how it was made, and
every relative link in the docs leads to a file."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("render_results", ROOT / "scripts" / "render_results.py")
render = importlib.util.module_from_spec(spec)
spec.loader.exec_module(render)


def test_docs_benchmarks_md_is_what_the_script_renders():
    want = render.render_doc(render.load())
    got = (ROOT / "docs" / "benchmarks.md").read_text()
    assert got == want, "docs/benchmarks.md differs from the results: run python scripts/render_results.py"


def test_page_figures_are_rendered():
    """Each figure span of README.md and docs/*.md is its rendering, and every rendered figure is quoted."""
    pages = render.figure_pages()
    assert ROOT / "README.md" in pages and ROOT / "docs" / "benchmarks.md" not in pages
    assert render.quoted_figures(pages) == set(render.FIGURES), "a figure span without a renderer, or back"
    results = render.load()
    for page in pages:
        text = page.read_text()
        assert render.render_spans(text, results, page.name) == text, \
            f"a figure in {page.relative_to(ROOT)} differs from the results: run python scripts/render_results.py"


def test_a_figure_in_any_page_is_checked(tmp_path):
    """A docs page's span is rendered like the README's, and a span without a renderer is refused naming the page."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("")
    (tmp_path / "docs" / "benchmarks.md").write_text("<!-- fig:nope -->x<!-- /fig -->")
    page = tmp_path / "docs" / "page.md"
    page.write_text("reward <!-- fig:default_job -->typed by hand<!-- /fig -->.")
    pages = render.figure_pages(tmp_path)
    assert pages == [tmp_path / "README.md", page]
    rendered = render.render_spans(page.read_text(), render.load(), "docs/page.md")
    assert "typed by hand" not in rendered and "mean reward" in rendered
    try:
        render.render_spans("<!-- fig:nope -->x<!-- /fig -->", {}, "docs/page.md")
    except KeyError as e:
        assert "docs/page.md" in str(e) and "nope" in str(e)
    else:
        raise AssertionError("an unknown figure name was rendered")


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
ARRIVING = {"docs/agents.md"}
"""Pages linked before the branch that writes them is merged (docs/agents.md comes with the agents work)."""


def test_doc_links_resolve():
    """Every relative link in README.md and docs/*.md names a file of the repository."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
            if not path.exists() and rel not in ARRIVING:
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, f"links to missing files: {broken}"


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
