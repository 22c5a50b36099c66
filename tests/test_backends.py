"""Which backend serves the model's device: a process group made without naming one
("undefined": cpu:gloo, cuda:nccl) runs zerofn's gloo path on the CPU and NCCL's
averaging reduce-scatter on GPUs, and a device no backend of the group serves, or a CUDA
device other than the current one, is refused at set-up with what to do."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from zerofn.runtime.comm import device_problems, serving


@pytest.mark.parametrize("config, device, backend", [
    ("cpu:gloo,cuda:nccl", "cuda", "nccl"), ("cpu:gloo,cuda:nccl", "cpu", "gloo"),
    ("cpu:gloo", "cpu", "gloo"), ("cpu:gloo", "cuda", ""), ("cuda:nccl", "cpu", ""),
    ("cpu:gloo,cuda:gloo", "cuda", "gloo"), ("gloo", "cuda", "gloo"),
])
def test_the_backend_serving_a_device(config, device, backend):
    assert serving(config, device) == backend


def test_a_device_no_backend_serves_or_not_current_is_refused():
    assert device_problems(torch.device("cpu"), "gloo", None) == []
    assert device_problems(torch.device("cuda", 1), "nccl", 1) == []
    (none,) = device_problems(torch.device("cpu"), "", None)
    assert "no backend for cpu tensors" in none and "'gloo'" in none
    (elsewhere,) = device_problems(torch.device("cuda", 1), "nccl", 0)
    assert "current CUDA device is cuda:0" in elsewhere and "set_device(1)" in elsewhere


UNDEFINED = textwrap.dedent("""
    import torch, torch.distributed as dist, zerofn as zf
    from zerofn.runtime.runtime import runtime_of
    dist.init_process_group(init_method="file://" + STORE, rank=0, world_size=1)
    assert dist.get_backend() == "undefined"
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = zf.compose(zf.shard_optimizer(), zf.shard_grads(), zf.shard_params())(model, opt)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    comm = runtime_of(model).ctx.comm
    print(comm.backend, comm._in_place, comm.averages)
    dist.destroy_process_group()
""")


def test_a_group_made_without_a_backend_runs_the_gloo_path_on_the_cpu(tmp_path):
    # (a file store: a port found free may be taken by another test's group before use)
    done = subprocess.run([sys.executable, "-c", f"STORE = {str(tmp_path / 'store')!r}\n"
                           + UNDEFINED],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["gloo", "True", "False"]
