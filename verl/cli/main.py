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
import re
import subprocess
import sys

SUITES = ("kernels", "dataflow", "reshard", "engines", "e2e", "scaling", "async", "compat", "agent", "tito", "faults",
          "quant")


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="verl bench", description="Run a benchmark suite (results: JSON + PNG "
                                     "under benchmarks/results/). Options after the suite go to the suite's scripts "
                                     "that take them (e.g. `verl bench e2e --workload smollm2-gsm8k` runs the "
                                     "scripts that have a --workload option); the others are skipped.")
    parser.add_argument("suite", choices=SUITES)
    parser.add_argument("args", nargs=argparse.REMAINDER, help="passed to the suite's scripts that take them")
    args = parser.parse_args(argv)
    folder = os.path.join(_repo_root(), "benchmarks", args.suite)
    scripts = sorted(glob.glob(os.path.join(folder, "bench_*.py")))
    if not scripts:
        print(f"verl bench: no benchmark scripts in {folder}; benchmarks run from a source checkout of verl",
              file=sys.stderr)
        return 2
    wanted = {a.split("=", 1)[0] for a in args.args if a.startswith("--")}
    chosen = [s for s in scripts if wanted <= script_options(s)]
    if not chosen:
        have = sorted(set().union(*(script_options(s) for s in scripts)))
        print(f"verl bench {args.suite}: no script of the suite takes {' '.join(sorted(wanted))}; its scripts' "
              f"options: {' '.join(have) or '(none)'}", file=sys.stderr)
        return 2
    rc = 0
    for script in scripts:
        name = os.path.relpath(script, _repo_root())
        if script not in chosen:
            print(f"== {name}: skipped (it takes no {' '.join(sorted(wanted - script_options(script)))})", flush=True)
            continue
        print(f"== {name}", flush=True)
        rc |= subprocess.call([sys.executable, script, *args.args], cwd=_repo_root())
    return rc


def script_options(path: str) -> set[str]:
    """The --options a benchmark script's argument parser declares (read from its source: every benchmark script
    builds its parser with add_argument("--name", ...), and importing them would pull in torch)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return set(re.findall(r"add_argument\(\s*(?:\"-\w\",\s*)?\"(--[A-Za-z0-9][\w-]*)\"", text)) | {"--help"}


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
