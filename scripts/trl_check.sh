#!/usr/bin/env bash
# verl's kernels inside TRL, in the TRL environment (`bash scripts/setup_env.sh trl`: TRL 1.16 over the dev
# environment): the VerlGRPOTrainer of examples/kernels_in_trl.py computes TRL's own loss, gradients included,
# for every loss type it fuses (tests/examples, marker `trl`), then benchmarks/e2e/bench_trl_kernels.py --quick
# trains both trainers a few steps side by side. Strict mode (VERL_TEST_ENV=trl): a TRL that does not import
# fails the check, naming the import error.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
t0=$SECONDS
venv=$(bash scripts/setup_env.sh trl | tail -n1)
echo "[trl-check] environment: $((SECONDS - t0))s ($venv)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
t1=$SECONDS
set +e
VERL_TEST_ENV=trl "$venv/bin/python" -m pytest -q -p no:cacheprovider --timeout=900 -m trl tests/examples
rc=$?
set -e
echo "[trl-check] TRL tests: $((SECONDS - t1))s (pytest exit $rc)"
[ "$rc" -eq 5 ] && { echo "[trl-check] pytest ran no tests: failing" >&2; exit 1; }
[ "$rc" -eq 0 ] || exit "$rc"
t1=$SECONDS
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$venv/bin/python" benchmarks/e2e/bench_trl_kernels.py --quick --out "$out/bench_trl_kernels.json"
echo "[trl-check] bench_trl_kernels.py --quick: $((SECONDS - t1))s"
