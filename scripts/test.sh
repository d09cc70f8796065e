#!/usr/bin/env bash
# Sets everything up (cached venv + CPU build of verl._C) and runs the whole test suite in strict mode
# (VERL_TEST_ENV=dev, tests/conftest.py): a dependency of the dev environment that does not import fails the run
# naming the import error, a test skipped for anything but absent hardware fails, and the skip reasons are printed
# with their counts at the end. Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/ops -x`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
t0=$SECONDS
venv=$(bash scripts/setup_env.sh dev | tail -n1)
echo "[test] environment + CPU build: $((SECONDS - t0))s ($venv)"
t1=$SECONDS
set +e
VERL_TEST_ENV=dev "$venv/bin/python" -m pytest -q -p no:cacheprovider --timeout=900 --durations=25 "$@"
rc=$?
set -e
echo "[test] tests: $((SECONDS - t1))s (pytest exit $rc)"
# pytest exits 5 when it collected no test: that is a failure here, never a pass.
[ "$rc" -eq 5 ] && { echo "[test] pytest ran no tests: failing" >&2; exit 1; }
exit "$rc"
