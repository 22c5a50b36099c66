"""A 94M-parameter stack of Linear layers (1.13 GB of fp32 master and Adam state), and the
process's resident memory, for the tests that bound what zerofn holds in host memory."""
from __future__ import annotations

import torch
from torch import nn

import zerofn as zf

WIDTH, LAYERS = 3072, 10          # 94M params: master + Adam state = 1.13 GB in fp32


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def status_bytes(field: str) -> int:
    """A size /proc/self/status reports for this process (VmRSS, VmHWM, VmData...)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    """The process's peak resident memory (VmHWM) starts again from its current use."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def stack_trainer(*transforms):
    """The Stack under ``transforms``, and a training step, taken once already so every
    buffer exists and is touched."""
    torch.manual_seed(0)
    model = Stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = zf.compose(*transforms)(model, opt)
    x = torch.randn(8, WIDTH)

    def step():
        model(x).backward()
        opt.step()
        opt.zero_grad()

    step()
    return model, step


def peak_rise_over(step, times: int) -> int:
    """How far the process's peak resident memory rises above its current use while
    ``step`` runs ``times`` times."""
    reset_peak()
    before = status_bytes("VmRSS")
    for _ in range(times):
        step()
    return status_bytes("VmHWM") - before


def large_free_returned_mib() -> float:
    """MiB a freed 16 MiB block gives back to the OS at once. A 24 MiB block is freed first
    (mmapped at glibc's start threshold, so a moving threshold rises to 24 MiB); the 16 MiB
    one sits below a live small block: on the heap its memory stays resident, mmapped (the
    threshold fixed at 16 MiB or less, as ``zf.return_large_frees()`` fixes it) it goes."""
    def rss_mib():
        return status_bytes("VmRSS") / (1 << 20)
    big = torch.ones(6 << 20)
    del big
    mid = torch.ones(4 << 20)
    keep = torch.ones(1 << 10)
    before = rss_mib()
    del mid
    returned = before - rss_mib()
    del keep
    return returned

