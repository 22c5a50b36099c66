"""tools/lowp_memory.py runs each combination of stored dtypes in its own process and
prints a row for each, whose measured host bytes per parameter are the estimate's. A tiny
model: at this size the peaks are torch's own, so none is asserted, and the host ring (a
few units' rows) is a large share of the bytes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "lowp_memory.py"


def test_every_combination_gets_a_row_and_the_host_bytes_are_the_estimates():
    done = subprocess.run([sys.executable, str(SCRIPT), "--width", "64", "--layers", "1",
                           "--vocab", "256", "--tokens", "16", "--steps", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")]
            for ln in done.stdout.splitlines() if ln.startswith(("| fp32", "| bf16"))]
    assert [(r[0], r[1]) for r in rows] == [("fp32", "fp32"), ("fp32", "bf16"), ("fp32", "int8"),
                                            ("bf16", "bf16"), ("bf16", "int8")]
    for r in rows:
        peak, measured, estimate = float(r[2]), float(r[6]), float(r[7])
        assert peak > 0 and abs(measured - estimate) < 0.05 * estimate, r
    host = {(r[0], r[1]): float(r[6]) for r in rows}
    ring = host["fp32", "fp32"] - 12       # masters and moments in fp32: 12 bytes
    assert ring > 0                        # the host ring: 3 units' gradients, rows over them
    assert host["fp32", "bf16"] == round(8 + ring, 2) and host["bf16", "bf16"] == round(6 + ring, 2)
    assert host["fp32", "int8"] < host["fp32", "bf16"] and host["bf16", "int8"] < host["bf16", "bf16"]
