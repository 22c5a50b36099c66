#!/usr/bin/env bash
# Sets up, then runs the whole test suite (multi-rank tests spawn real gloo processes), in
# the interpreter setup.sh installed into (scripts/python.sh says which). Arguments go to
# pytest, e.g.: bash scripts/test.sh tests/test_api.py -m "not multirank".
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. scripts/python.sh
exec "$(zerofn_python)" -m pytest -q "$@"
