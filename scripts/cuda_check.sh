#!/usr/bin/env bash
# The CUDA compile check (no GPU needed): in a second environment with the CUDA 13 build of torch, build
# verl._C with nvcc (sm_90 by default; the cached build of the same sources and toolchain when there is one,
# scripts/setup_env.sh), import it, check that the dispatcher has CPU and CUDA kernels for every
# op, and run the ops' CPU tests against that build. The kernels cannot run without a GPU; compiling, linking
# and registering them is the check.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
t0=$SECONDS
venv=$(bash scripts/setup_env.sh cuda | tail -n1)
echo "[cuda-check] environment + nvcc build: $((SECONDS - t0))s ($venv)"
# Stage a tree whose verl/ carries the CUDA build of _C (the checkout's in-place _C is the CPU env's).
stage=build/cuda/stage
rm -rf "$stage"
mkdir -p "$stage"
cp -r verl tests pyproject.toml setup.py csrc "$stage"/
find "$stage/verl" -name '_C*.so' -delete
cp build/cuda/lib/verl/_C*.so "$stage/verl/"
cd "$stage"
"$venv/bin/python" - <<'PY'
import torch
from verl import _extension as E
assert E.available(), f"verl._C (CUDA build) does not import: {E.load_error()}"
assert E.built_with_cuda(), "verl._C was built without CUDA kernels"
ops = E.op_names()
missing = {key: [op for op in ops if not E.has_kernel(op, key)] for key in ("CPU", "CUDA")}
assert ops and not missing["CPU"] and not missing["CUDA"], f"ops without kernels: {missing}"
print(f"[cuda-check] torch {torch.__version__}: verl._C archs {E.cuda_archs()}, {len(ops)} ops with CPU and CUDA kernels")
PY
"$venv/bin/python" -m verl.cli.main doctor || true
t1=$SECONDS
set +e
VERL_TEST_ENV=cuda "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/ops tests/test_setup.py
rc=$?
set -e
echo "[cuda-check] ops CPU tests against the CUDA build: $((SECONDS - t1))s (pytest exit $rc)"
[ "$rc" -eq 5 ] && { echo "[cuda-check] pytest ran no tests: failing" >&2; exit 1; }
exit "$rc"
