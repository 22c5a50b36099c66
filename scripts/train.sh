#!/usr/bin/env bash
# Sets up, then runs the main job (`zerofn train`): the small GPT on the built-in corpus,
# ZeRO-3, 200 steps, on 2 ranks (one per GPU where there are GPUs). Arguments go to the
# job, e.g.: bash scripts/train.sh --stage 2 --precision bf16 --nproc 4; --help lists them.
# It runs in the interpreter setup.sh installed into (scripts/python.sh says which).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. scripts/python.sh
exec "$(zerofn_python)" -m zerofn train "$@"
