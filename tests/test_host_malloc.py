"""Asked (``zf.return_large_frees()``), zerofn fixes glibc's mmap threshold, so large freed
blocks go back to the OS (zerofn/runtime/host_malloc.py); a threshold the user chose is
left alone, and a transform alone changes nothing."""
import os
import platform
import subprocess
import sys

import pytest

from support.jobs import SCRIPT_PATH

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# Prints the MiB a freed 16 MiB block gives back (support/memory.py's probe) in a fresh
# process: without zerofn, after a transform, or after zf.return_large_frees().
SCRIPT = r"""
import sys, tempfile, torch, torch.distributed as dist
import zerofn as zf
from support.memory import large_free_returned_mib

if sys.argv[1] == "asked":
    zf.return_large_frees()
if sys.argv[1] in ("transformed", "asked"):
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1),
                            rank=0, world_size=1)
    model = torch.nn.Linear(8, 8)
    zf.compose(zf.shard_optimizer(), zf.shard_grads(), zf.shard_params())(
        model, torch.optim.AdamW(model.parameters()))
print(f"{large_free_returned_mib():.1f}")
"""


def returned_mib(mode: str, **env) -> float:
    env = {k: v for k, v in os.environ.items()
           if k != "MALLOC_MMAP_THRESHOLD_" and "GLIBC_TUNABLES" not in k} | env
    env["PYTHONPATH"] = SCRIPT_PATH         # (the probe is the tests' own: support/)
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return float(done.stdout.split()[-1])


def test_asked_zerofn_returns_large_freed_blocks_and_a_transform_alone_does_not():
    plain, transformed, asked = (returned_mib(m) for m in ("plain", "transformed", "asked"))
    print(f"\n16 MiB block freed after a 24 MiB one: {plain} MiB returned without zerofn, "
          f"{transformed} MiB after a transform, {asked} MiB after zf.return_large_frees()")
    assert plain < 2, "glibc's moving threshold kept the block: the control shows nothing"
    assert transformed < 2
    assert asked > 15


def test_a_threshold_the_user_chose_is_kept():
    # 32 MiB (glibc's largest): the 16 MiB block comes from the heap, as the user asked
    # (and a high trim threshold keeps glibc from trimming it should it top the heap).
    chosen = returned_mib("asked", MALLOC_MMAP_THRESHOLD_=str(32 << 20),
                          MALLOC_TRIM_THRESHOLD_=str(1 << 30))
    assert chosen < 2
