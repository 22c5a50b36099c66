#!/usr/bin/env bash
# Installs what zerofn and its tests need into the current python3, then builds zerofn in
# place. Only what is missing is installed, so a machine with everything already there
# (a GPU machine with no package index) sets up offline. torch is pinned only when none
# is installed: a GPU machine keeps its own build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# "import name=pip requirement" pairs: the core, the build, then the tests' extras.
NEEDS=(
  "torch=torch==2.13.0"
  "torchdata=torchdata" "tensorboard=tensorboard" "safetensors=safetensors"
  "pybind11=pybind11" "setuptools=setuptools" "wheel=wheel"
  "pytest=pytest" "hypothesis=hypothesis" "nbclient=nbclient" "ipykernel=ipykernel"
  "matplotlib=matplotlib" "transformers=transformers>=5,<6" "accelerate=accelerate"
  "sphinx=sphinx>=9,<10" "furo=furo>=2025,<2027"
  "lightning=lightning>=2.6,<2.7"
)
missing=()
for pair in "${NEEDS[@]}"; do
  $PY -c "import ${pair%%=*}" 2>/dev/null || missing+=("${pair#*=}")
done
# torch first and alone: with it in place, the rest never pulls another build of it.
rest=()
for req in "${missing[@]}"; do
  if [[ $req == torch==* ]]; then $PY -m pip install -q "$req"; else rest+=("$req"); fi
done
if ((${#rest[@]})) && ! $PY -m pip install -q "${rest[@]}"; then
  # Offline (a GPU machine with no index): go on; tests needing these skip and say why.
  echo "setup: could not install ${rest[*]}; continuing without them" >&2
fi
$PY -m pip install -q --no-build-isolation --no-deps -e .
