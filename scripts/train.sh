#!/usr/bin/env bash
# Sets up, then trains the small GPT on the built-in corpus on 2 ranks (ZeRO-3 by default).
# Arguments go to the job, e.g.: bash scripts/train.sh --stage 2 --steps 300
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec ${PYTHON:-python3} -m torch.distributed.run --standalone --nproc-per-node 2 -m zerofn.train "$@"
