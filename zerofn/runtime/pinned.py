"""Host memory page-locked at exactly the size asked for, only where the device is CUDA.

[Note: exact pinning] PyTorch's pinned allocator (``pin_memory=True``,
``Tensor.pin_memory()``) is a caching host allocator that rounds every block up to a
power of two: a 45 GB offload arena would pin 64 GB, an 80 GB one ask for 128 GB. Here
each buffer is its own anonymous memory mapping (page-aligned, zero-filled by the kernel
as pages are first touched), page-locked in place with ``cudaHostRegister``, which pins
exactly its pages; it is unregistered when the tensor is collected. Non-blocking copies
from and to it run asynchronously like any pinned copy.

[Note: what is page-locked] ``Tensor.is_pinned()`` does not ask about the tensor's data:
it asks CUDA about the first byte of the tensor's *storage* (torch 2.11 and 2.13 alike).
A buffer carved out of a larger allocation, page-aligned inside it, had its storage start
before the registered pages, so ``is_pinned()`` said False of memory that was in fact
page-locked (and copied as such). Here the mapping is the storage, so the two agree; but
zerofn's own answer is ``page_locked``, which asks CUDA's driver about the first and last
byte of the tensor's data, whatever its storage.

Whether to pin is decided by the device the runtime computes on, never by whether CUDA
happens to be installed: a CPU-device run on a GPU machine pins nothing and never
initializes CUDA.
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import weakref

import torch

PAGE = mmap.PAGESIZE
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
        A 1-D tensor whose storage starts at its first element, on a page boundary (what
        O_DIRECT needs too). Its registration, if any, ends when it is collected (views
        keep it alive).

    Example:
        >>> arena = host_buffer(1 << 20, torch.float32, pins(torch.device("cuda")))
    """
    if not numel:
        return torch.zeros(0, dtype=dtype)
    nbytes = numel * dtype.itemsize
    # Private: a forked child gets its own copy, not shared memory. The tensor keeps the
    # mapping alive; it is unmapped when the tensor's storage is freed.
    try:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:   # (as torch's own allocator fails: a MemoryError, said plainly)
        raise MemoryError(
            f"could not allocate {nbytes / 2**30:.2f} GiB of host memory ({e.strerror}): the "
            "host, or the process's address-space limit, has no room for this offload buffer. "
            "Free host memory, or offload less (NVMe offload, a smaller model, more ranks)."
        ) from e
    buf = torch.frombuffer(mapping, dtype=dtype, count=numel)
    if pin:
        _pin(buf)
    return buf


def registered_bytes() -> int:
    """Host bytes this process has page-locked through ``host_buffer`` and still holds."""
    return sum(_registered.values())


def is_registered(t: torch.Tensor) -> bool:
    return t.data_ptr() in _registered


def page_locked(t: torch.Tensor) -> bool:
    """Whether CUDA holds all of ``t``'s data page-locked, asked of the driver for its first
    and last byte ([Note: what is page-locked]). False where CUDA is not initialized: then
    nothing can have been registered."""
    if t.device.type != "cpu" or not t.numel() or not torch.cuda.is_initialized():
        return False
    torch.cuda.set_device(torch.cuda.current_device())   # the primary context is current
    last = t.data_ptr() + (t.numel() - 1) * t.element_size()
    return _host_memory_type(t.data_ptr()) and _host_memory_type(last)


def _pin(buf: torch.Tensor) -> None:
    ptr, nbytes = buf.data_ptr(), buf.nbytes
    err = _register(ptr, nbytes)
    if err != 0:
        raise RuntimeError(
            f"cudaHostRegister of {nbytes / 2**30:.2f} GiB of host memory failed (cudaError "
            f"{err}). Page-locked memory may be limited (`ulimit -l`) or exhausted; raise the "
            "limit, or offload less (fewer units in flight, a smaller model).")
    _registered[ptr] = nbytes
    # Every view, however nested, keeps ``buf`` (its ``_base``) alive, and a dying tensor
    # clears its weak references before its storage (the mapping) is freed: so the memory
    # is unregistered after its last view and before it is unmapped. Not at exit: the
    # process's memory goes away with it.
    weakref.finalize(buf, _release, ptr).atexit = False


def _release(ptr: int) -> None:
    if _registered.pop(ptr, None) is not None:
        _unregister(ptr)


def _register(ptr: int, nbytes: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_MEMORYTYPE_HOST = 2, 1     # cuda.h


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _host_memory_type(ptr: int) -> bool:
    """The driver's view of one address: page-locked host memory (registered, or from
    cudaHostAlloc). Unregistered memory is an invalid value to it."""
    kind = ctypes.c_uint(0)
    err = _driver().cuPointerGetAttribute(ctypes.byref(kind), CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                          ctypes.c_uint64(ptr))
    return err == 0 and kind.value == CU_MEMORYTYPE_HOST
