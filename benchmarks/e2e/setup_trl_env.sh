#!/usr/bin/env bash
# The TRL environment for benchmarks/e2e (TRL's GRPOTrainer beside verl): scripts/setup_env.sh trl, which layers
# TRL over the dev environment (its torch, transformers and verl._C, seen through a .pth file). Prints the
# environment's folder on its last line.
set -euo pipefail
exec bash "$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/scripts/setup_env.sh" trl
