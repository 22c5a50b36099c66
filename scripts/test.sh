#!/usr/bin/env bash
# Sets up, then runs the whole test suite (multi-rank tests spawn real gloo processes), in
# the interpreter setup.sh installed into (scripts/python.sh says which).
#   bash scripts/test.sh          the suite: three pytest workers (pytest-xdist, a file per
#                                 worker at a time), then the tests marked `timed` alone
#   bash scripts/test.sh ARGS     pytest ARGS in one process, e.g.
#                                 bash scripts/test.sh tests/test_api.py -m "not multirank"
# Much of a run is waiting (rendezvous, launches, timeouts waited out): two workers kept the
# 2-core CI machine's cores about 1.3 busy, so a third fills them; `timed` tests assert on
# clocks, so they run unloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. scripts/python.sh
python=$(zerofn_python)
if (($#)); then
  exec "$python" -m pytest -q "$@"
fi
workers=()   # set-up offline (no package index) may leave pytest-xdist out: then serial
"$python" -c "import xdist" 2>/dev/null && workers=(-n "${ZEROFN_TEST_WORKERS:-3}" --dist loadfile)
rc=0
# One intra-op thread a process while the workers share the cores: spare threads only spin.
OMP_NUM_THREADS=1 "$python" -m pytest -q --durations=20 "${workers[@]}" -m "not timed" || rc=$?
"$python" -m pytest -q --durations=10 -m timed || rc=$?
exit "$rc"
