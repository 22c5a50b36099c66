"""offload("nvme") with ≥ 1 GB of optimizer state: host memory for it stays within the
staging ring, by zerofn's accounting and by the process's peak resident memory."""
from __future__ import annotations

import pytest
import torch

import zerofn as zf
from support.memory import WIDTH, peak_rise_over, stack_trainer
from support.ranks import run_ranks

pytestmark = pytest.mark.multirank


def train_big(rank, world, path):
    model, step = stack_trainer(zf.shard_grads(),
                                zf.offload("nvme", path=path, units_in_flight=2))
    weight = model.layers[0].weight.detach().clone()
    peak_rise = peak_rise_over(step, 2)
    moved = not torch.equal(weight, model.layers[0].weight)
    return zf.model_state_bytes(model), peak_rise, moved


def test_nvme_keeps_host_optimizer_memory_within_units_in_flight(tmp_path):
    mem, peak_rise, moved = run_ranks(1, train_big, str(tmp_path), timeout=300)[0]
    state = mem["nvme"]["optimizer"]
    unit = 3 * (WIDTH * WIDTH + WIDTH) * 4           # one layer's master + Adam state
    assert state >= 1e9, state
    # units_in_flight = 2 staging buffers, plus the per-parameter step counters
    assert mem["host"]["optimizer"] <= 2 * unit + 65536, mem
    assert mem["cpu"]["optimizer"] == 0, mem
    # Two full steps streamed 1.13 GB of state through memory; the process grew by far less.
    assert peak_rise < 0.25 * state, (peak_rise, state)
    assert moved
