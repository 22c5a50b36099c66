#!/usr/bin/env bash
# Sets up, then runs the whole test suite (multi-rank tests spawn real gloo processes), in
# the interpreter setup.sh installed into (scripts/python.sh says which).
#   bash scripts/test.sh          the suite: two pytest workers (pytest-xdist, a file per
#                                 worker at a time), then the tests marked `timed` alone
#   bash scripts/test.sh ARGS     pytest ARGS in one process, e.g.
#                                 bash scripts/test.sh tests/test_api.py -m "not multirank"
# Much of a serial run is waiting (rendezvous, launches, timeouts waited out), so a second
# worker fills the 2-core CI machine; `timed` tests assert on clocks, so they run unloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. scripts/python.sh
python=$(zerofn_python)
if (($#)); then
  exec "$python" -m pytest -q "$@"
fi
workers=()   # set-up offline (no package index) may leave pytest-xdist out: then serial
"$python" -c "import xdist" 2>/dev/null && workers=(-n "${ZEROFN_TEST_WORKERS:-2}" --dist loadfile)
rc=0
# One intra-op thread a process while two workers share the cores: spare threads only spin.
OMP_NUM_THREADS=1 "$python" -m pytest -q --durations=20 "${workers[@]}" -m "not timed" || rc=$?
"$python" -m pytest -q --durations=10 -m timed || rc=$?
exit "$rc"
