"""Page-locked host memory: registered at exactly its size (not rounded to a power of two
like PyTorch's pinned allocator), unregistered after its last view, and only for a CUDA
device. CUDA's registration calls are replaced by recorders here, so this runs anywhere;
tests/test_offload_copies.py checks real pinning on a GPU."""
from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import zerofn.runtime.pinned as pinned
from zerofn.runtime.homes import NvmeHome
from zerofn.core.plan import OffloadPolicy
from zerofn.runtime.homes import ALIGN, HomeSpec, HostHome
from zerofn.core.units import Unit


@pytest.fixture
def calls(monkeypatch):
    """CUDA's host registration, recorded instead of performed."""
    log = {"register": [], "unregister": []}
    monkeypatch.setattr(pinned, "_register",
                        lambda ptr, n: log["register"].append((ptr, n)) or 0)
    monkeypatch.setattr(pinned, "_unregister", lambda ptr: log["unregister"].append(ptr))
    return log


def test_a_buffer_is_registered_at_its_exact_size_until_its_last_view_dies(calls):
    before = pinned.registered_bytes()
    buf = pinned.host_buffer(3 * 1000 + 7, torch.bfloat16, pin=True)
    assert buf.numel() == 3007 and buf.data_ptr() % pinned.PAGE == 0
    assert calls["register"] == [(buf.data_ptr(), 3007 * 2)]
    assert pinned.registered_bytes() - before == 6014 and pinned.is_registered(buf)
    ptr, view = buf.data_ptr(), buf[10:20].view(2, 5)
    del buf
    gc.collect()
    assert calls["unregister"] == []            # a view still uses the memory
    del view
    gc.collect()
    assert calls["unregister"] == [ptr] and pinned.registered_bytes() == before


def test_the_registered_pages_are_the_storage_that_is_pinned_asks_about(calls):
    """``Tensor.is_pinned()`` asks CUDA about the storage's first byte, not the data's: a
    buffer page-aligned inside a larger storage was page-locked yet said it was not."""
    buf = pinned.host_buffer(5000, torch.float32, pin=True)
    storage = buf.untyped_storage()
    assert calls["register"] == [(storage.data_ptr(), storage.nbytes())] == [(buf.data_ptr(),
                                                                             5000 * 4)]
    assert not pinned.page_locked(buf)   # no CUDA here: the driver is never asked


def test_nothing_is_registered_without_pin(calls):
    buf = pinned.host_buffer(100, torch.float32, pin=False)
    assert calls["register"] == [] and not pinned.is_registered(buf)
    assert not buf.any()                        # zeroed


def test_a_buffer_the_host_has_no_room_for_is_a_memory_error_that_says_so():
    with pytest.raises(MemoryError, match="GiB of host memory"):   # past any address space
        pinned.host_buffer(2**60, torch.uint8, pin=False)


def test_a_failed_registration_says_what_to_do(monkeypatch):
    monkeypatch.setattr(pinned, "_register", lambda ptr, n: 2)   # cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError, match="ulimit -l"):
        pinned.host_buffer(100, torch.float32, pin=True)


def test_only_cuda_devices_pin():
    assert pinned.pins(torch.device("cuda", 1)) and pinned.pins("cuda")
    assert not pinned.pins(torch.device("cpu")) and not pinned.pins(None)


def units_on(device: str, sizes, compute=torch.float32) -> list[Unit]:
    return [Unit(f"u{i}", nn.Module(), shard_numel=n, dtype=torch.float32,
                 device=torch.device(device), compute_dtype=compute, master_dtype=torch.float32)
            for i, n in enumerate(sizes)]


def spec_for(path=None) -> HomeSpec:
    """Homes built for the offload alone, gradients landing in bf16 (the reduce dtype)."""
    return HomeSpec(OffloadPolicy(device="nvme" if path else "cpu", path=path),
                    torch.bfloat16, torch.device("cpu"))


def test_offload_for_a_cuda_device_pins_exactly_its_arenas(calls):
    """Masters, bf16 compute copies and gradients at set-up, Adam's moments once AdamW is
    bound: each arena registered once, at the sum of its aligned views; the step counters
    (host only) are not pinned."""
    sizes = [1000, 3000, 70]
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))])
    store = HostHome(units_on("cuda", sizes, torch.bfloat16), spec_for())
    aligned = sum(-(-n // ALIGN) * ALIGN for n in sizes)
    laid_out = [aligned * 4, aligned * 2, aligned * 2]   # fp32 masters | bf16 | bf16 grads
    assert sorted(n for _, n in calls["register"]) == sorted(laid_out)
    store.bind(opt)
    want = sorted(laid_out + [aligned * 4 * 2])          # | fp32 moments
    assert sorted(n for _, n in calls["register"]) == want
    # (and the step counters, unpinned: none here, these units hold no parameters)
    assert sorted(a.buffer.nbytes for a in store.arenas()) == sorted(want + [0])
    on_cpu = HostHome(units_on("cpu", sizes, torch.bfloat16), spec_for())
    on_cpu.bind(opt)
    assert len(calls["register"]) == 4 and on_cpu.arenas()


def test_nvme_pins_its_staging_ring_and_gradients_for_a_cuda_device(calls, tmp_path):
    units = units_on("cuda", [5000, 200])
    store = NvmeHome(units, spec_for(str(tmp_path)))
    block = max(store.file.block.values())
    assert all(b.data_ptr() % 4096 == 0 and b.nbytes == block for b in store.staging)   # O_DIRECT
    assert sorted(n for _, n in calls["register"]) == sorted(
        [block, block, -(-5000 // ALIGN) * ALIGN * 2 + -(-200 // ALIGN) * ALIGN * 2])
