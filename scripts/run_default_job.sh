#!/usr/bin/env bash
# Sets everything up (cached venv + CPU build of verl._C) and runs the default job.
# Until the trainer lands this is: `verl doctor`, then a real kernel-vs-reference demonstration.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv=$(bash scripts/setup_env.sh dev | tail -n1)
"$venv/bin/verl" doctor
"$venv/bin/python" examples/ops_demo.py "$@"
