#!/usr/bin/env bash
# Sets up, then runs the whole test suite (multi-rank tests spawn real gloo processes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec ${PYTHON:-python3} -m pytest -q "$@"
