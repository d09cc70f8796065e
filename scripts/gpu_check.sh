#!/usr/bin/env bash
# The whole GPU check in one command, for a lent GPU machine (H200, the torch already installed there, e.g. 2.11
# cu130 on Python 3.12, no network), sized to finish in under 8 minutes:
#   1. build verl._C with CUDA (sm_90) in place, against the installed torch       (budget 210 s)
#   2. every `cuda`-marked test                                                   (budget 120 s)
#   3. kernel benchmarks: achieved HBM bandwidth / 4.8 TB/s, and the fused RL loss
#      head vs eager / torch.compile at N=16384, V=151936, bfloat16               (budget 90 s)
#   4. one PPO step of the default job on megatron-core over NCCL                 (budget 60 s)
# Results (JSON, PNG, logs, summary.json) go to $OUT, or benchmarks/results/gpu/ when OUT is unset. A failing
# step is recorded and the next one still runs; the exit status is non-zero when any step failed.
#
#   bash scripts/gpu_check.sh             # on the GPU machine
#   bash scripts/gpu_check.sh --dry-run   # anywhere: checks the plan, the tools, the imports and runs the
#                                         # benchmark code at toy sizes on the CPU; builds nothing, needs no CUDA
#
# megatron-core: with no network, it is installed from a wheel in $VERL_WHEELS (default: shared/wheels, then
# wheels/) when it does not import; without one, step 4 is skipped with the reason. PYTHON picks the interpreter.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
dry=0
[ "${1:-}" = "--dry-run" ] && dry=1
py=${PYTHON:-python3}
out=${OUT:-$root/benchmarks/results/gpu}
mkdir -p "$out"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
t_start=$SECONDS
declare -A status
log() { echo "[gpu-check $((SECONDS - t_start))s] $*"; }

# run NAME BUDGET_S CMD...: the step's output goes to $out/NAME.log (and the terminal); status recorded.
run() {
  local name=$1 budget=$2
  shift 2
  log "step $name (budget ${budget}s): $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$budget" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  status[$name]="rc=$rc wall=$((SECONDS - t0))s"
  log "step $name: ${status[$name]}"
}

wheels=${VERL_WHEELS:-}
[ -z "$wheels" ] && for d in shared/wheels wheels; do [ -d "$d" ] && { wheels=$d; break; }; done

megatron_ready() {
  "$py" -c "import megatron.core" 2>/dev/null && return 0
  [ -n "$wheels" ] && ls "$wheels"/megatron_core-*.whl >/dev/null 2>&1 || return 1
  [ "$dry" = 1 ] && return 0
  "$py" -m pip install -q --no-index --find-links "$wheels" megatron-core >/dev/null 2>&1
}

ppo_step=("$py" -m torch.distributed.run --standalone --nproc_per_node=1 -m verl.trainer.main_ppo actor.engine=megatron trainer.device=cuda
          trainer.total_steps=1 warmup.steps=0 trainer.output_dir="$out/megatron_step" trainer.overwrite=true
          trainer.export_hf=false trainer.save_final=false trainer.progress_bar=false trainer.plot=false)

if [ "$dry" = 1 ]; then
  log "dry run: plan and imports, no build, no CUDA"
  fail=0
  check() { if "$@" >/dev/null 2>&1; then log "  ok: $*"; else log "  MISSING: $*"; fail=1; fi; }
  check test -f setup.py
  check "$py" -c "import torch, pytest, ninja"
  check "$py" -c "from verl import _extension as E; assert E.available(), E.load_error(); import verl.ops"
  check "$py" -c "import verl.ops as O; assert 'linear_rl_loss' in dir(O)"
  command -v nvcc >/dev/null && log "  nvcc: $(nvcc --version | tail -n1)" || log "  (no nvcc here: step 1 needs one)"
  n_cuda=$("$py" -m pytest --collect-only -q -p no:cacheprovider -m cuda tests 2>/dev/null | grep -c '::')
  log "  step 2 would run $n_cuda cuda-marked tests"
  [ "$n_cuda" -gt 0 ] || fail=1
  run bench_gpu_dry 300 "$py" benchmarks/kernels/bench_gpu.py --dry-run --out "$out/dry_run"
  [[ ${status[bench_gpu_dry]} == rc=0* ]] || fail=1
  check "$py" -c "from verl.config import PPOConfig, load_config; load_config(PPOConfig, None, [a for a in '''${ppo_step[*]}'''.split() if '=' in a and not a.startswith('--')])"
  if megatron_ready; then log "  megatron-core: importable or wheel in ${wheels:-?}"; else log "  megatron-core: neither importable nor a wheel in \$VERL_WHEELS/shared/wheels/wheels: step 4 would be skipped"; fi
  log "plan: build (210s) + cuda tests (120s) + benchmarks (90s) + megatron PPO step (60s) <= 8 min"
  log "  step 1: VERL_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 $py setup.py build_ext --inplace"
  log "  step 2: $py -m pytest -q -m cuda tests"
  log "  step 3: $py benchmarks/kernels/bench_gpu.py --out $out"
  log "  step 4: ${ppo_step[*]}"
  log "dry run $([ $fail = 0 ] && echo passed || echo FAILED) in $((SECONDS - t_start))s"
  exit $fail
fi

"$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/nvidia_smi.csv" 2>&1 || true
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} VERL_BUILD_CUDA=1
if ! command -v ninja >/dev/null && ! "$py" -c "import ninja" 2>/dev/null; then  # setup.py builds with ninja
  [ -n "$wheels" ] && "$py" -m pip install -q --no-index --find-links "$wheels" ninja >/dev/null 2>&1
  command -v ninja >/dev/null || "$py" -c "import ninja" 2>/dev/null || log "no ninja and no ninja wheel: step 1 will fail"
fi
run build 210 "$py" setup.py -q build_ext --inplace --build-temp build/gpu/temp
run cuda_tests 120 "$py" -m pytest -q -p no:cacheprovider -m cuda tests --junitxml="$out/cuda_tests.xml"
run bench_gpu 90 "$py" benchmarks/kernels/bench_gpu.py --out "$out"
if megatron_ready; then
  run megatron_ppo_step 60 "${ppo_step[@]}"
else
  status[megatron_ppo_step]="skipped: megatron-core does not import and no wheel in \$VERL_WHEELS, shared/wheels or wheels/"
  log "step megatron_ppo_step ${status[megatron_ppo_step]}"
fi
{
  echo "{"
  first=1
  for k in build cuda_tests bench_gpu megatron_ppo_step; do
    [ $first = 1 ] || echo ","
    first=0
    printf '  "%s": "%s"' "$k" "${status[$k]:-not run}"
  done
  printf ',\n  "total_s": %d\n}\n' $((SECONDS - t_start))
} > "$out/summary.json"
cat "$out/summary.json"
for k in build cuda_tests bench_gpu megatron_ppo_step; do
  [[ ${status[$k]:-} == rc=0* || ${status[$k]:-} == skipped* ]] || exit 1
done
exit 0
