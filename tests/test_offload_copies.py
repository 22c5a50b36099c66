"""The offload copy pipeline (runtime/copies.py) is ordered: every read and every rewrite of
a copied buffer waits for its copy.

On CPU the real copies are synchronous, so ordering mistakes would go unseen. Here a test
double defers each copy to the last moment the ordering allows, the wait that must come
before its data is used or its source rewritten. Anything read before its wait is stale,
and training then differs from the same run with synchronous copies.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import pytest
import torch

import zerofn as zf
import zerofn.runtime.runtime as runtime_module
from support.compare import state_errors
from support.loops import build_parity, train_sharded, zero
from support.models import batches, make_models, make_optimizer
from support.offload import offload_transform
from support.ranks import run_ranks
from support.shared_runs import shared
from zerofn.runtime.copies import CopyStreams
from zerofn.runtime.homes.ring import DEPTH
from zerofn.runtime.pinned import page_locked
from zerofn.runtime.runtime import runtime_of

pytestmark = pytest.mark.multirank

ACCUM, STEPS, CLIP = 3, 4, 0.05
# (stage, optimizer, offload options, compute dtype)
CONFIGS = [(1, "adamw", {}, None), (2, "adamw", {}, None), (3, "adamw", {}, None),
           (3, "adamw", {"params": True}, None), (2, "sgd", {}, None),
           (1, "adamw", {}, torch.bfloat16), (3, "adamw", {"params": True}, torch.bfloat16),
           (2, "adamw", {}, torch.float16), (2, "adamw", {"nvme": True}, None),
           (3, "adamw", {"nvme": True}, torch.bfloat16)]


class DeferredCopies(CopyStreams):
    """Copies queued per (direction, unit) and performed only at a wait for that unit: the
    destination is written, and the source read, as late as the ordering allows. A copy
    whose source changed between its issue and its run read data it was not given (on a
    GPU a race between the copy's stream and the writer's): ``stale`` counts those."""

    def __init__(self, device, units, *args, **kwargs):
        super().__init__(device, units, *args, **kwargs)
        self._pending = defaultdict(list)
        self.performed = 0
        self.stale = 0
        self.most_pending = 0       # copies queued at once, across units

    def to_host(self, unit, dst, src):
        self._defer("d2h", unit, dst, src)

    def to_device(self, unit, dst, src):
        self._defer("h2d", unit, dst, src)

    def _defer(self, direction, unit, dst, src):
        self._pending[direction, unit].append((dst, src, src.clone()))
        self.most_pending = max(self.most_pending, self.pending())

    def _run(self, direction, unit):
        for dst, src, issued in self._pending.pop((direction, unit), ()):
            self.stale += not _same(src, issued)
            dst.copy_(src)
            self.performed += 1

    def pending(self) -> int:
        return sum(map(len, self._pending.values()))

    def host_wait(self, unit):
        self._run("d2h", unit)

    def device_wait(self, unit):
        self._run("h2d", unit)

    def before_host_write(self, unit):
        self._run("h2d", unit)

    def before_device_write(self, unit):
        self._run("d2h", unit)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, NaN to NaN (an fp16 overflow's gradients hold NaNs)."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def skipping(wait: str):
    """A broken pipeline: ``wait`` does nothing."""
    return type(f"Skips_{wait}", (DeferredCopies,), {wait: lambda self, unit: None})


@contextlib.contextmanager
def copies_class(cls):
    """Runtimes built inside use ``cls`` for their copies."""
    before = runtime_module.CopyStreams
    runtime_module.CopyStreams = cls
    try:
        yield
    finally:
        runtime_module.CopyStreams = before


def train(stage, kind, offload, dtype, data, rank, world, copies=CopyStreams, group=None,
          layers=None):
    """Accumulation over each step's micro-batches and clipping; on the device of ``group``
    (the world's gloo group by default: the CPU)."""
    device = "cuda" if group is not None else "cpu"
    _, model = make_models(**({"layers": layers} if layers else {}))
    model = model.to(device)
    opt = make_optimizer(kind, model.parameters())
    extra = ([offload_transform(offload)] if offload is not None else []) + \
        ([zf.mixed_precision(dtype)] if dtype else [])
    with copies_class(copies):
        model, opt = zf.compose(zero(stage, group=group), *extra)(model, opt)
    data = [[(x.to(device), y.to(device)) for x, y in micro] for micro in data]
    train_sharded(model, opt, data, rank, world, CLIP, scale=True)
    return zf.get_state_dict(model, opt, full=True), runtime_of(model)


def deferred_runs(rank, world, path, configs):
    data = batches(STEPS, ACCUM, world)
    plain = {}      # the run without offload, trained once per (stage, optimizer)
    out = []
    for stage, kind, opts, dtype in configs:
        opts = dict(opts, path=path)
        synced, _ = train(stage, kind, opts, dtype, data, rank, world)
        deferred, rt = train(stage, kind, opts, dtype, data, rank, world, DeferredCopies)
        copies = rt.ctx.copies
        r = {"vs_synced": max(state_errors(synced, deferred)), "performed": copies.performed,
             "most_pending": copies.most_pending, "left": copies.pending(),
             "stale": copies.stale}
        if dtype is None:   # only fp32 is held to the run without offload
            if (stage, kind) not in plain:
                plain[stage, kind] = train(stage, kind, None, None, data, rank, world)[0]
            r["vs_plain"] = max(state_errors(plain[stage, kind], deferred))
        out.append(r)
    return out


def cpu_runs(rank, world, path):
    """The CPU tests' runs at this world, in one launch: at world 1 the deferred copies,
    the missing waits and the rewrite; at world 2 the deferred copies, the ring, and last
    the run that forbids pinning (it replaces torch's factories for the rest of it)."""
    if world == 1:
        return {"deferred": deferred_runs(rank, world, path, CONFIGS),
                "missing": missing_wait_runs(rank, world, path),
                "rewrite": rewrite_runs(rank, world, path)}
    return {"deferred": deferred_runs(rank, world, path, CONFIGS),
            "ring": ring_runs(rank, world, path), "unpinned": unpinned_runs(rank, world, path)}


@pytest.fixture(scope="module")
def on_cpu(tmp_path_factory):
    """``on_cpu(world)``: cpu_runs' results, each a list over the ranks, from one launch a
    world, made when a test first asks for it."""
    @shared
    def launched(world):
        path = str(tmp_path_factory.mktemp(f"copies{world}"))
        per_rank = run_ranks(world, cpu_runs, path, timeout=500)
        return {name: [r[name] for r in per_rank] for name in per_rank[0]}
    return launched


@pytest.mark.parametrize("world", [1, 2])
def test_deferred_copies_train_like_synchronous_ones(world, on_cpu):
    """Every stage, cpu offload (params=True too), bf16, fp16 loss scaling, NVMe, a torch
    optimizer on the host; accumulation over 3 micro-batches and clipping."""
    for rank_out in on_cpu(world)["deferred"]:
        for config, r in zip(CONFIGS, rank_out):
            assert r["vs_synced"] == 0, (config, r)
            if config[3] is None:   # the fp32 run without offload: torch's Adam vs CPU Adam
                assert r["vs_plain"] < 1e-6, (config, r)
            # Copies really waited: many at once (a unit's copy outlived other units' work)
            # and every one performed by its wait.
            assert r["most_pending"] > 1 and r["performed"] > 0 and r["left"] == 0, (config, r)
            assert r["stale"] == 0, (config, r)     # no copy's source rewritten under it


# Where leaving out each wait shows on CPU. ``before_host_write`` guards host rows that a
# copy to the device may still read; here ``device_wait`` performs that copy first, except
# for NVMe, whose staging buffers are rewritten before the ZeRO-3 shards are waited for: with
# one buffer, the next unit's compute rows overwrite those the last copy had yet to read.
MISSING = [("host_wait", (2, "adamw", {}, None)), ("device_wait", (3, "adamw", {}, None)),
           ("device_wait", (1, "adamw", {}, torch.bfloat16)),
           ("device_wait", (3, "adamw", {"params": True}, None)),   # a staged shard's gather
           ("before_host_write", (3, "adamw", {"nvme": True, "units_in_flight": 1},
                                  torch.bfloat16))]


def missing_wait_runs(rank, world, path):
    data = batches(STEPS, ACCUM, world)
    out = []
    for wait, (stage, kind, opts, dtype) in MISSING:
        opts = dict(opts, path=path)
        synced, _ = train(stage, kind, opts, dtype, data, rank, world)
        broken, _ = train(stage, kind, opts, dtype, data, rank, world, skipping(wait))
        out.append(max(state_errors(synced, broken)))
    return out


def test_a_missing_wait_shows(on_cpu):
    """The double has teeth: without any one of the waits, training differs."""
    for case, err in zip(MISSING, on_cpu(1)["missing"][0]):
        assert not err < 1e-4, case   # nan too: a buffer the copy never filled


def rewrite_runs(rank, world, path):
    data = batches(STEPS, ACCUM, world)
    _, rt = train(2, "adamw", {"path": path, "nvme": True}, None, data, rank, world,
                  skipping("before_device_write"))
    return rt.ctx.copies.stale


def test_a_reduction_adds_into_a_shard_only_after_its_copy_read_it(on_cpu):
    """Under accumulation each backward's reduction adds into the shard the last one sent
    to the host (gradients that land during backward: NVMe's here). Without
    ``before_device_write`` the addition overtakes the copy still reading it: on a GPU,
    the race the CUDA sanitizer reported between the reduce stream and the copy stream."""
    assert on_cpu(1)["rewrite"][0] > 0


def ring_runs(rank, world, path):
    """ZeRO-3 under bf16 with offload("cpu"): more units than the host ring has slots, so
    within a step a slot takes the next unit's gradients while ZeRO-3's copies up are
    waited for only after the step."""
    data = batches(STEPS, ACCUM, world)
    config = (3, "adamw", {"path": path}, torch.bfloat16)
    synced, _ = train(*config, data, rank, world, layers=2 * DEPTH)
    deferred, rt = train(*config, data, rank, world, DeferredCopies, layers=2 * DEPTH)
    broken, _ = train(*config, data, rank, world, skipping("before_host_write"),
                      layers=2 * DEPTH)
    return (max(state_errors(synced, deferred)), rt.ctx.copies.stale,
            max(state_errors(synced, broken)))


def test_a_ring_slot_takes_new_gradients_only_after_its_rows_went_up(on_cpu):
    """[Note: the host ring]: each slot's next gradients come down only after the rows in it
    went up; without ``before_host_write`` they overwrite rows a copy had yet to read."""
    for vs_synced, stale, vs_broken in on_cpu(2)["ring"]:
        assert vs_synced == 0 and stale == 0
        assert not vs_broken < 1e-4


def unpinned_runs(rank, world, path):
    """CPU-device offload with pinning forbidden: every way to ask for page-locked memory
    raises. The model is on the CPU whatever the machine has, so on a GPU machine too
    nothing may be pinned, and CUDA must not even be initialized."""
    import zerofn.runtime.pinned as pinned

    def refuse(*args, **kwargs):
        raise AssertionError("pinned memory requested for a CPU-device run")

    def no_pinning(make):
        def wrapped(*args, **kwargs):
            if kwargs.get("pin_memory"):
                refuse()
            return make(*args, **kwargs)
        return wrapped

    torch.Tensor.pin_memory = refuse
    pinned._register = refuse
    for name in ("zeros", "empty", "ones", "full", "empty_strided", "tensor"):
        setattr(torch, name, no_pinning(getattr(torch, name)))
    data = batches(2, 2, world)
    arenas = []
    for stage, opts, dtype in ((1, {}, None), (2, {}, torch.bfloat16),
                               (3, {"params": True}, torch.bfloat16),
                               (3, {"nvme": True, "path": path, "params": True}, None)):
        extra = [zf.mixed_precision(dtype)] if dtype else []
        model, opt = build_parity(stage, "adamw", offload_transform(opts), *extra)
        train_sharded(model, opt, data, rank, world)
        rt = runtime_of(model)
        assert not rt.ctx.copies.streaming
        arenas += rt.homes.arenas()
    started = torch.cuda.is_initialized()   # before is_pinned, which may start it
    assert not any(a.buffer.is_pinned() for a in arenas) and pinned.registered_bytes() == 0
    return started


def test_cpu_only_offload_never_pins(on_cpu):
    assert on_cpu(2)["unpinned"] == [False, False]


class SynchronousCopies(CopyStreams):
    """What CopyStreams does without CUDA: blocking copies, waits that do nothing."""

    streaming = False


SLEEP_CYCLES = 2_000_000    # ~1 ms of GPU clock: a copy or collective held back that long


class SleepyCopies(CopyStreams):
    """Real side streams, each copy held back by a spin on its stream first, so anything
    that reads its data without waiting for it reads stale data."""

    def _copy(self, direction, unit, dst, src):
        if self.streaming and dst.device != src.device:
            with torch.cuda.stream(self._streams[direction]):
                torch.cuda._sleep(SLEEP_CYCLES)
        super()._copy(direction, unit, dst, src)


@contextlib.contextmanager
def sleepy_collectives():
    """Every collective zerofn issues starts after a spin on the stream it is issued from."""
    from zerofn.runtime.comm import Comm
    plain = {name: getattr(Comm, name) for name in ("all_gather", "reduce_scatter")}

    def held_back(fn):
        def call(self, *args, **kwargs):
            torch.cuda._sleep(SLEEP_CYCLES)
            return fn(self, *args, **kwargs)
        return call

    for name, fn in plain.items():
        setattr(Comm, name, held_back(fn))
    try:
        yield
    finally:
        for name, fn in plain.items():
            setattr(Comm, name, fn)


# Every offload configuration on the device: (stage, optimizer, offload options, dtype).
CUDA_CONFIGS = [(1, "adamw", {}, None), (2, "adamw", {}, torch.bfloat16), (2, "sgd", {}, None),
                (2, "adamw", {}, torch.float16), (3, "adamw", {}, None),
                (3, "adamw", {}, torch.bfloat16), (3, "adamw", {"params": True}, torch.bfloat16),
                (1, "adamw", {"nvme": True}, None),
                (3, "adamw", {"nvme": True, "params": True}, torch.bfloat16)]


def cuda_runs(rank, world, path, configs, sleepy):
    """One rank over NCCL: side streams (copies and collectives held back when ``sleepy``)
    against blocking copies of the same run."""
    import torch.distributed as dist
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.cuda.set_device(0)
    group = dist.new_group(backend="nccl")
    data = batches(STEPS, ACCUM, world)
    out = []
    # Attention by the math kernel: the fused ones' backward may accumulate with atomics
    # (memory-efficient attention is picked for fp32), which warn_only lets through.
    with sdpa_kernel(SDPBackend.MATH):
        for config in configs:
            out.append(_streamed_against_synced(config, path, data, rank, world, group, sleepy))
    return out


def _streamed_against_synced(config, path, data, rank, world, group, sleepy):
    stage, kind, opts, dtype = config
    opts = dict(opts, path=path)
    synced, _ = train(stage, kind, opts, dtype, data, rank, world, SynchronousCopies, group)
    with sleepy_collectives() if sleepy else contextlib.nullcontext():
        streamed, rt = train(stage, kind, opts, dtype, data, rank, world,
                             SleepyCopies if sleepy else CopyStreams, group)
    # Page-locked as the driver sees each view's data, and as is_pinned() reports it
    # (runtime/pinned.py's [Note: what is page-locked]).
    pinned = all(page_locked(t) and t.is_pinned() for t in device_facing(rt) if t.numel())
    return max(state_errors(synced, streamed)), rt.ctx.copies.streaming, pinned


def device_facing(rt) -> list[torch.Tensor]:
    """The host buffers copies to and from the device use: gradient landing buffers, the
    rows that go back up (host arenas), or NVMe's staging ring."""
    store = rt.homes
    if hasattr(store, "staging"):
        return list(store.grads.values()) + list(store.staging)
    return list(store.grads.values()) + [store.updated_rows(u) for u in rt.units]


@pytest.mark.cuda
@pytest.mark.parametrize("sleepy", [False, True])
def test_cuda_copy_streams_train_like_blocking_copies(monkeypatch, tmp_path, sleepy):
    """Bit for bit, in every offload configuration; with every copy and collective held
    back (``sleepy``), a missing wait would read stale data."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # deterministic cuBLAS
    results = run_ranks(1, cuda_runs, str(tmp_path), CUDA_CONFIGS, sleepy, timeout=600)[0]
    for config, (err, streaming, pinned) in zip(CUDA_CONFIGS, results):
        assert streaming and pinned and err == 0, (config, err)
