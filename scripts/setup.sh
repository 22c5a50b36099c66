#!/usr/bin/env bash
# Installs what zerofn needs into the current python3, then builds zerofn in place.
# torch is pinned to the CPU build only when none is installed: a GPU machine keeps its own.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch" 2>/dev/null; then
  $PY -m pip install -q "torch==2.13.0"
fi
$PY -m pip install -q torchdata tensorboard safetensors pytest pybind11 setuptools wheel
$PY -m pip install -q --no-build-isolation --no-deps -e .
