"""scripts/reliability_report.py puts each outcome in the category its docstring defines, including tests that
kill pytest itself or overrun the per-test timeout (support tests: not reliability cases themselves)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("reliability_report", ROOT / "scripts" / "reliability_report.py")
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)

SAMPLE = '''
import os, time, pytest

def test_clear_ok():
    with pytest.raises(ValueError, match="lr"):
        raise ValueError("lr must be finite")

def test_behaves_ok():
    assert 1 + 1 == 2

def test_clear_silently_accepted():
    with pytest.raises(ValueError):
        pass

def test_clear_message_without_the_key():
    with pytest.raises(ValueError, match="lr"):
        raise ValueError("bad value")

def test_behaves_wrong_result():
    assert 1 + 1 == 3

def test_clear_raw_library_error():
    with pytest.raises(ValueError):
        {}["lr"]

def test_clear_process_dies():
    os._exit(3)

def test_behaves_own_bound():
    pytest.fail("HANG: still running after 5 s")

def test_behaves_overruns_the_timeout():
    time.sleep(60)

@pytest.fixture
def broken():
    raise OSError("no disk")

def test_clear_setup_fails(broken):
    pass

@pytest.mark.skip(reason="no GPU")
def test_clear_skipped():
    pass

def test_table_size():
    assert True
'''


def test_every_category_is_recognised(tmp_path):
    suite = tmp_path / "test_sample.py"
    suite.write_text(SAMPLE)
    results = report.run_suite(str(suite), [], timeout_s=8)
    got = {nodeid.split("::")[-1]: report.classify(nodeid, r["when"], r["outcome"], r["crash"], r["text"])
           for nodeid, r in results.items()}
    assert got == {"test_clear_ok": "clear", "test_behaves_ok": "behaves", "test_clear_silently_accepted": "silent",
                   "test_clear_message_without_the_key": "unclear", "test_behaves_wrong_result": "silent",
                   "test_clear_raw_library_error": "crash", "test_clear_process_dies": "crash",
                   "test_behaves_own_bound": "hang", "test_behaves_overruns_the_timeout": "hang",
                   "test_clear_setup_fails": "error", "test_clear_skipped": "skipped", "test_table_size": "support"}
    text, ok, rows = report.report(results, min_cases=5)
    assert not ok and "clear=1  behaves=1  silent=2  unclear=1  crash=2  hang=2  error=1" in text, text


@pytest.mark.parametrize("nodeid, want", [("t.py::test_clear_x[a-b]", "clear"), ("t.py::test_behaves_y", "behaves"),
                                          ("t.py::test_case_count", None), ("t.py::TestK::test_clear_z", "clear"),
                                          ("t.py::test_x[a::test_clear_b]", None)])
def test_declared_category_from_the_name(nodeid, want):
    assert report.declared(nodeid) == want
