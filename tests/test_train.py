"""The main job, run for real: two gloo ranks under torchrun, a tiny model, a few steps."""
import math
import re
import subprocess
import sys

import pytest

TINY = ["--steps", "20", "--batch", "8", "--width", "64", "--heads", "2", "--ffn", "128",
        "--layers", "2", "--context", "32", "--eval-batches", "2", "--log-every", "1"]


def run_job(*args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "zerofn.train", *TINY, *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("stage", [3, 2, 1])
def test_job_trains_and_reports(stage):
    out = run_job("--stage", str(stage))
    losses = [float(v) for v in re.findall(r"^step +\d+/20 +loss (\S+)", out, re.M)]
    assert len(losses) == 20, out
    # An untrained byte-level model guesses uniformly over 256 bytes.
    assert abs(losses[0] - math.log(256)) < 0.2, out
    assert losses[-1] < losses[0] - 1.0, out
    final = re.search(rf"^final loss (\S+) after 20 steps \(ZeRO-{stage}, 2 ranks\)$", out, re.M)
    assert final and float(final.group(1)) == pytest.approx(losses[-1], abs=1e-4), out
    val = re.search(r"validation loss (\S+)", out)
    assert val and float(val.group(1)) < losses[0], out
