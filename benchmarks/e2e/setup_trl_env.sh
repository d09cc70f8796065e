#!/usr/bin/env bash
# Creates the TRL baseline venv (default /root/.cache/verl-trl) for benchmarks/e2e/bench_grpo_vs_trl.py.
# The venv sees the dev venv's site-packages through a .pth file (lower priority than its own), so torch and
# transformers are shared and only TRL + accelerate + datasets are installed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dev=${VERL_DEV_VENV:-/root/.cache/verl-dev}
venv=${VERL_TRL_VENV:-/root/.cache/verl-trl}
if [ ! -f "$venv/.complete" ]; then
  python3 -m venv "$venv"
  site=$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
  devsite=$("$dev/bin/python" -c 'import site; print(site.getsitepackages()[0])')
  echo "$devsite" > "$site/verl_dev_site.pth"
  "$venv/bin/python" -m pip install -q -r "$root/requirements/trl.txt"
  "$venv/bin/python" -c 'import torch, trl; assert torch.version.cuda is None, "TRL venv pulled a CUDA torch"; print("trl", trl.__version__, "torch", torch.__version__)'
  touch "$venv/.complete"
fi
echo "$venv"
