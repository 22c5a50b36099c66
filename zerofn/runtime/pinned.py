"""Host memory page-locked at exactly the size asked for, only where the device is CUDA.

[Note: exact pinning] PyTorch's pinned allocator (``pin_memory=True``,
``Tensor.pin_memory()``) is a caching host allocator that rounds every block up to a
power of two: a 45 GB offload arena would pin 64 GB, an 80 GB one ask for 128 GB. Here
plain host memory is allocated (page-aligned) and page-locked in place with
``cudaHostRegister``, which pins exactly its pages; it is unregistered when the tensor is
collected. ``Tensor.is_pinned()`` reports such memory as pinned, and non-blocking copies
from and to it run asynchronously like any pinned copy.

Whether to pin is decided by the device the runtime computes on, never by whether CUDA
happens to be installed: a CPU-device run on a GPU machine pins nothing and never
initializes CUDA.
"""
from __future__ import annotations

import weakref

import torch

PAGE = 4096
_registered: dict[int, int] = {}     # pointer -> bytes page-locked by this module


def pins(device) -> bool:
    """Whether host buffers serving ``device`` are page-locked: only for CUDA devices."""
    return device is not None and torch.device(device).type == "cuda"


def host_buffer(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A zeroed, page-aligned host tensor of ``numel`` elements; page-locked if ``pin``.

    Args:
        numel: elements.
        dtype: their dtype.
        pin: register the memory with CUDA (``pins(device)`` says when).

    Returns:
        A 1-D tensor whose first byte is page-aligned. Its registration, if any, ends when
        it is collected (views keep it alive).

    Example:
        >>> arena = host_buffer(1 << 20, torch.float32, pins(torch.device("cuda")))
    """
    itemsize = dtype.itemsize
    raw = torch.zeros(numel + PAGE // itemsize, dtype=dtype)
    skip = (-raw.data_ptr() % PAGE) // itemsize
    buf = raw[skip:skip + numel]
    if pin and numel:
        _pin(buf, raw)
    return buf


def registered_bytes() -> int:
    """Host bytes this process has page-locked through ``host_buffer`` and still holds."""
    return sum(_registered.values())


def is_registered(t: torch.Tensor) -> bool:
    return t.data_ptr() in _registered


def _pin(buf: torch.Tensor, root: torch.Tensor) -> None:
    ptr, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
    err = _register(ptr, nbytes)
    if err != 0:
        raise RuntimeError(
            f"cudaHostRegister of {nbytes / 2**30:.2f} GiB of host memory failed (cudaError "
            f"{err}). Page-locked memory may be limited (`ulimit -l`) or exhausted; raise the "
            "limit, or offload less (fewer units in flight, a smaller model).")
    _registered[ptr] = nbytes
    # Every view, however nested, keeps ``root`` (its ``_base``) alive, and a dying tensor
    # clears its weak references before its storage is freed: so the memory is
    # unregistered after its last view and before it is freed. Not at exit: the process's
    # memory goes away with it.
    weakref.finalize(root, _release, ptr).atexit = False


def _release(ptr: int) -> None:
    if _registered.pop(ptr, None) is not None:
        _unregister(ptr)


def _register(ptr: int, nbytes: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)
