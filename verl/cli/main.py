"""The `verl` command line.

    verl doctor                      # check torch / CUDA / nvcc / verl._C / megatron-core / engines
    verl train CONFIG [k=v ...]      # PPO / GRPO from a YAML config plus dotted overrides
    verl bench SUITE [args ...]      # run a benchmark suite (kernels, dataflow, reshard, engines, e2e, scaling,
                                     # async, compat, agent, tito, faults, quant)
    verl algos [--json]              # the registered policy losses, advantage estimators, KL penalties
    verl compat SCRIPT.sh|CONFIG     # what an upstream verl launch script / YAML becomes here (before it runs)
    verl compat --keys               # the translation table of upstream verl's config keys
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys

SUITES = ("kernels", "dataflow", "reshard", "engines", "e2e", "scaling", "async", "compat", "agent", "tito", "faults",
          "quant")


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="verl bench", description="Run a benchmark suite (results: JSON + PNG "
                                     "under benchmarks/results/).")
    parser.add_argument("suite", choices=SUITES)
    parser.add_argument("args", nargs=argparse.REMAINDER, help="passed to every benchmark script of the suite")
    args = parser.parse_args(argv)
    folder = os.path.join(_repo_root(), "benchmarks", args.suite)
    scripts = sorted(glob.glob(os.path.join(folder, "bench_*.py")))
    if not scripts:
        print(f"verl bench: no benchmark scripts in {folder}; benchmarks run from a source checkout of verl",
              file=sys.stderr)
        return 2
    rc = 0
    for script in scripts:
        print(f"== {os.path.relpath(script, _repo_root())}", flush=True)
        rc |= subprocess.call([sys.executable, script, *args.args], cwd=_repo_root())
    return rc


def _train(argv: list[str]) -> int:
    try:
        from verl.trainer.main_ppo import main as train_main
    except ImportError as e:
        print(f"verl train: the trainer is not available in this installation ({e})", file=sys.stderr)
        return 2
    from verl.errors import run_cli
    return run_cli(train_main, argv, prog="verl train")


def _algos(argv: list[str]) -> int:
    from verl.cli.algos import main as algos_main
    return algos_main(argv)


def _compat(argv: list[str]) -> int:
    from verl.cli.compat import main as compat_main
    from verl.errors import run_cli
    return run_cli(compat_main, argv, prog="verl compat")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"doctor": None, "train": _train, "bench": _bench, "algos": _algos, "compat": _compat}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__.strip())
        if argv and argv[0] not in ("-h", "--help"):
            import difflib
            near = difflib.get_close_matches(argv[0], list(commands), n=1)
            print(f"\nverl: unknown command {argv[0]!r}" + (f"; did you mean {near[0]!r}?" if near else ""),
                  file=sys.stderr)
            return 2
        return 0
    if argv[0] == "doctor":
        from verl.cli.doctor import main as doctor_main
        return doctor_main(argv[1:])
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
