"""`verl bench SUITE [options]` hands the options to the suite's scripts that take them and skips the others."""

import glob
import os

from verl.cli import main as cli


def _suite(tmp_path, monkeypatch):
    folder = tmp_path / "benchmarks" / "e2e"
    folder.mkdir(parents=True)
    body = ("import argparse, pathlib, sys\nap = argparse.ArgumentParser()\n{opts}\na = ap.parse_args()\n"
            "pathlib.Path(sys.argv[0]).with_suffix('.ran').write_text(repr(vars(a)))\n")
    (folder / "bench_a.py").write_text(body.format(opts='ap.add_argument("--workload")\nap.add_argument("--steps", '
                                                        'type=int, default=1)'))
    (folder / "bench_b.py").write_text(body.format(opts='ap.add_argument("--steps", type=int, default=1)'))
    monkeypatch.setattr(cli, "_repo_root", lambda: str(tmp_path))
    return folder


def test_options_go_to_the_scripts_that_take_them(tmp_path, monkeypatch, capsys):
    folder = _suite(tmp_path, monkeypatch)
    assert cli.main(["bench", "e2e", "--workload=smollm2-gsm8k", "--steps", "2"]) == 0
    assert (folder / "bench_a.ran").read_text() == "{'workload': 'smollm2-gsm8k', 'steps': 2}"
    assert not (folder / "bench_b.ran").exists()
    assert "bench_b.py: skipped (it takes no --workload)" in capsys.readouterr().out
    assert cli.main(["bench", "e2e", "--steps", "3"]) == 0  # both take --steps: both run
    assert (folder / "bench_b.ran").read_text() == "{'steps': 3}"


def test_an_option_no_script_takes_is_refused_with_the_suites_options(tmp_path, monkeypatch, capsys):
    _suite(tmp_path, monkeypatch)
    assert cli.main(["bench", "e2e", "--workloads", "x"]) == 2
    err = capsys.readouterr().err
    assert "no script of the suite takes --workloads" in err and "--workload" in err and "--steps" in err


def test_every_shipped_benchmark_script_declares_its_options_as_read():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    scripts = glob.glob(os.path.join(root, "benchmarks", "*", "bench_*.py"))
    assert scripts
    for path in scripts:
        text = open(path, encoding="utf-8").read()
        # an option the reader would miss (a parser built otherwise) would make `verl bench` skip its script
        assert text.count('add_argument("--') == len(cli.script_options(path) - {"--help"}), path
    grpo = os.path.join(root, "benchmarks", "e2e", "bench_grpo_vs_trl.py")
    assert "--workload" in cli.script_options(grpo)
