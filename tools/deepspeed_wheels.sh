#!/usr/bin/env bash
# Fills wheels/ with what `tools/gpu_check.py --parts deepspeed` installs on a GPU machine
# that has no package index: a DeepSpeed wheel built here with no compiled ops (they
# compile just in time there, with that machine's nvcc and ninja) and the dependencies a
# CUDA PyTorch image usually lacks, for the GPU machine's Python. Run it where pip reaches
# an index and torch is installed (DeepSpeed's setup.py imports torch), then carry wheels/
# to the GPU machine.
#   bash tools/deepspeed_wheels.sh [PYTHON_VERSION]   # default 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TARGET=${1:-3.12}
mkdir -p wheels
DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation -w wheels \
  "deepspeed==${DEEPSPEED_VERSION:-0.19.8}"
# pydantic-core is compiled: take the build for the target Python, not this one.
$PY -m pip download -q --only-binary :all: --python-version "$TARGET" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d wheels \
  hjson "pydantic>=2"
ls wheels
