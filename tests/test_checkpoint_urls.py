"""Checkpoints at fsspec URLs: ``memory://`` (world 1: it is one process's own), ``file://``
and a local S3 server (moto, where moto and s3fs are installed) at world 2. What a save
writes there is what it writes to a local path, byte for byte but the save's own identity
in ``.metadata``; loads, checksums, ``zerofn verify`` and the safe reader work on it; and
a save that fails mid-write leaves nothing visible, the previous checkpoint whole."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pickle
import tempfile
import zlib

import fsspec
import pytest
import torch
import torch.distributed as dist

import zerofn as zf
from support.compare import assert_same_state, full_state
from support.errors import error_of, expect_error
from support.ranks import run_ranks
from support.shared_runs import shared
from zerofn.consolidate import to_dcp, to_full
from zerofn.io.checkpoint import audit, checksums, layout

pytestmark = pytest.mark.multirank

STAGES = {
    "zero1": lambda: [zf.shard_optimizer()],
    "zero3": lambda: [zf.shard_optimizer(), zf.shard_grads(), zf.shard_params()],
    "zero3_cpu_offload": lambda: [zf.shard_optimizer(), zf.shard_grads(), zf.shard_params(),
                                  zf.offload("cpu")],
    "zero3_nvme_offload": lambda: [zf.shard_optimizer(), zf.shard_grads(), zf.shard_params(),
                                   zf.offload("nvme", path=tempfile.mkdtemp())],
}
S3_OPTIONS = {"key": "testing", "secret": "testing", "client_kwargs": {"region_name": "eu-west-1"}}


@dataclasses.dataclass
class Progress:
    """A user's own extra, of a class a safe load refuses until trusted."""
    tokens: int


def build(stage: str, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = zf.compose(*STAGES[stage]())(model, opt)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def files(ckpt: str) -> dict[str, bytes]:
    """``{name: bytes}`` of every file under ``ckpt`` (a path or URL), read through fsspec
    directly rather than through zerofn."""
    store, root = fsspec.core.url_to_fs(ckpt)
    return {os.path.relpath(p, root): store.cat_file(p) for p in store.find(root)}


def metadata_without_identity(data: bytes) -> bytes:
    """``.metadata`` re-pickled without its ``storage_meta`` (the directory it was written
    to and a random save id, which differ between any two saves)."""
    metadata = pickle.loads(data)       # (the test's own files: trusted)
    metadata.storage_meta = None
    return pickle.dumps(metadata)


def assert_alike(local: dict[str, bytes], other: dict[str, bytes]) -> None:
    """Two checkpoints hold the same files: data files byte for byte, ``.metadata`` but for
    its save identity, ``checksums.json`` but for ``.metadata``'s sum, which is right."""
    assert local.keys() == other.keys() and len(local) > 3, (sorted(local), sorted(other))
    for name in local:
        if name == checksums.METADATA:
            assert local[name] != other[name]      # (the identity does differ: compared)
            assert metadata_without_identity(local[name]) == \
                metadata_without_identity(other[name])
        elif name == checksums.SUMS:
            ours, theirs = (json.loads(d)["files"] for d in (local[name], other[name]))
            meta = theirs.pop(checksums.METADATA)
            assert meta == {"size": len(other[checksums.METADATA]),
                            "crc32": zlib.crc32(other[checksums.METADATA])}
            ours.pop(checksums.METADATA)
            assert ours == theirs
        else:
            assert local[name] == other[name], name


# -- the same bytes, every load path ------------------------------------------------------
def round_trip(rank, world, stage, local, url, options):
    """Sync (streamed, under offload) and background saves of one state to ``local`` and
    ``url``: the same files; the URL's loads back bit for bit, and verifies."""
    if options:
        fsspec.config.conf["s3"] = options
    checksums.FILE_BYTES = 512        # several data files a rank
    model, opt = build(stage)
    for root in (local, url):
        zf.save_checkpoint(root, model, opt, step=1, epoch=2)
        zf.save_checkpoint(root, model, opt, step=2, async_save=True, epoch=3)
        assert zf.wait_for_checkpoint() == f"{root}/step-00000002"
    dist.barrier()                    # (rank 0 has published both)
    for step in ("step-00000001", "step-00000002"):
        assert_alike(files(f"{local}/{step}"), files(f"{url}/{step}"))
    expected = full_state(model, opt)
    for path, extras in ((url, {"step": 2, "epoch": 3}),
                         (f"{url}/step-00000001", {"step": 1, "epoch": 2})):
        fresh, fresh_opt = build(stage, seed=1)
        assert zf.load_checkpoint(path, fresh, fresh_opt, epoch=None) == extras
        assert_same_state(full_state(fresh, fresh_opt), expected)
    found = audit.audit(url)
    assert found.ok and found.summed and found.ckpt == f"{url}/step-00000002", found
    assert audit.main([url]) == 0
    if rank == 0:
        consolidates(local, url)
    return True


def consolidates(local, url):
    """``to_full`` reads the URL's checkpoint as the local one; ``to_dcp`` writes one there."""
    full = {root: to_full(root, f"{local}/{n}.safetensors") for n, root in enumerate((local, url))}
    assert full[url].keys() == full[local].keys()
    assert all(torch.equal(full[url][k], full[local][k]) for k in full[local])
    to_dcp(f"{local}/1.safetensors", f"{url}/back")
    assert audit.audit(f"{url}/back").ok
    expect_error(["The consolidated file", "must be a local path", url], to_full, url,
                 f"{url}/full.safetensors")


def checked_and_safe(rank, world, url, options):
    """At ``url``: a user's class in an extra is refused until trusted; a flipped bit in a
    data file fails the load on every rank, naming the file, and ``verify`` finds it."""
    if options:
        fsspec.config.conf["s3"] = options
    model, opt = build("zero3")
    zf.save_checkpoint(f"{url}/own", model, opt, step=1, progress=Progress(7))
    message = error_of(zf.load_checkpoint, f"{url}/own", model, opt, progress=None)
    assert f"{__name__}.Progress" in message and "trust_class" in message, message
    assert zf.load_checkpoint(f"{url}/own", model, opt, trusted=True, progress=None) == \
        {"step": 1, "progress": Progress(7)}
    zf.save_checkpoint(f"{url}/flip", model, opt, step=1)
    data = f"{url}/flip/step-00000001/__0_0.distcp"
    if rank == 0:
        store = fsspec.core.url_to_fs(data)[0]
        raw = bytearray(store.cat_file(data))
        raw[len(raw) // 2] ^= 0x10
        store.pipe_file(data, bytes(raw))
    dist.barrier()
    expect_error(["__0_0.distcp", "does not match its checksum"], zf.load_checkpoint,
                 f"{url}/flip", model, opt)
    found = audit.audit(f"{url}/flip")
    assert not found.ok and any("__0_0.distcp" in p for p in found.problems), found
    return True


# The stages round-tripped at each world: memory:// URLs at world 1, file:// at world 2
ROUND_TRIPS = {1: sorted(STAGES), 2: ["zero1", "zero3_cpu_offload"]}


def url_of(world: int, root: str, name: str) -> str:
    return f"memory://{name}" if world == 1 else f"file://{root}/{name}"


def url_runs(rank, world, root):
    """The checks, then each round trip of ROUND_TRIPS at this world: ``{name: True}`` for
    each (a failed check raises, failing the launch)."""
    out = {"checks": checked_and_safe(rank, world, url_of(world, root, "checks"), None)}
    for stage in ROUND_TRIPS[world]:   # (after the checks: round_trip sets FILE_BYTES)
        out[stage] = round_trip(rank, world, stage, os.path.join(root, stage, "local"),
                                url_of(world, root, f"{stage}/ckpt"), None)
    return out


@pytest.fixture(scope="module")
def at_url(tmp_path_factory):
    """``at_url(world)``: url_runs' results on each rank, from one launch a world, made when
    a test first asks for it."""
    @shared
    def launched(world):
        root = str(tmp_path_factory.mktemp(f"urls{world}"))
        return run_ranks(world, url_runs, root, timeout=400)
    return launched


@pytest.mark.parametrize("stage", ROUND_TRIPS[1])
def test_memory_url_holds_the_local_bytes_and_loads_back(at_url, stage):
    assert [r[stage] for r in at_url(1)] == [True]


@pytest.mark.parametrize("stage", ROUND_TRIPS[2])
def test_file_url_at_world_2_holds_the_local_bytes_and_loads_back(at_url, stage):
    assert [r[stage] for r in at_url(2)] == [True, True]


@pytest.mark.parametrize("url", ["memory://checks", "file://{tmp}/checks"])
def test_checksums_and_safe_reader_at_a_url(at_url, url):
    world = 1 if url.startswith("memory") else 2
    assert [r["checks"] for r in at_url(world)] == [True] * world


# -- a local S3 server, where one is installed ---------------------------------------------
@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on a free port, with a bucket; skipped without moto and s3fs
    (optional: ``pip install moto[server] s3fs``)."""
    if not (importlib.util.find_spec("moto") and importlib.util.find_spec("s3fs")):
        pytest.skip("moto[server] and s3fs are not installed")
    from moto.server import ThreadedMotoServer
    import s3fs
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {**S3_OPTIONS, "endpoint_url": f"http://{host}:{port}"}
    s3fs.S3FileSystem(**options, skip_instance_cache=True).mkdir("ckpts")
    yield options
    server.stop()


def test_s3_at_world_2_holds_the_local_bytes_loads_back_and_is_checked(s3, tmp_path):
    assert run_ranks(2, round_trip, "zero3_cpu_offload", str(tmp_path / "local"),
                     "s3://ckpts/run", s3) == [True, True]
    assert run_ranks(2, checked_and_safe, "s3://ckpts/checks", s3) == [True, True]


# -- a save that fails mid-write ---------------------------------------------------------
def fail_on(where: str):
    """Make the save fail: ``"data"`` in the middle of its second data file (after its
    first has been written whole), ``"sums"`` as it writes checksums.json, the moment
    before ``.metadata`` would make the checkpoint visible."""
    if where == "sums":
        def write_sums(ckpt, sums):
            raise OSError(5, "injected: the connection dropped")
        checksums.write_sums = write_sums
        return
    plain = checksums._Summing.write

    def write(self, data):
        if getattr(self.raw, "path", "").endswith("_1.distcp") and self.size > 0:
            raise OSError(5, "injected: the connection dropped")
        return plain(self, data)
    checksums._Summing.write = write


def interrupted(rank, world, root, where, async_save, options=None):
    """A complete save of step 1, then one of step 2 that fails; then the same step 1
    again (written over in place at a URL), which fails too."""
    if options:
        fsspec.config.conf["s3"] = options
    checksums.FILE_BYTES = 256
    model, opt = build("zero3_cpu_offload")
    zf.save_checkpoint(root, model, opt, step=1)
    saved = full_state(model, opt)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    fail_on(where)
    for step in (2, 1):
        def save():
            zf.save_checkpoint(root, model, opt, step=step, async_save=async_save)
            zf.wait_for_checkpoint()
        ckpt = f"{root}/{layout.step_name(step)}"
        # (inside a data file torch.save reports the failure as its own RuntimeError)
        expect_error([ckpt, "not published"], save, error=Exception)
        dist.barrier()
        assert not fsspec.core.url_to_fs(ckpt)[0].exists(f"{ckpt}/{checksums.METADATA}")
        if step == 2:
            assert layout.complete_steps(root) == ["step-00000001"]
            expect_error(["did not finish", "no .metadata"], zf.load_checkpoint, ckpt,
                         model, opt)
            expect_error(["did not finish"], audit.audit, ckpt)
            fresh, fresh_opt = build("zero3_cpu_offload", seed=1)
            assert zf.load_checkpoint(root, fresh, fresh_opt) == {"step": 1}
            assert_same_state(full_state(fresh, fresh_opt), saved)
    # The one complete checkpoint was written over: none is left, and none is claimed.
    assert layout.complete_steps(root) == [] and zf.load_checkpoint(root, model, opt) is None
    return True


@pytest.mark.parametrize("where", ["data", "sums"])
@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_save_at_a_url_leaves_nothing_visible(where, async_save):
    assert run_ranks(1, interrupted, "memory://failed", where, async_save) == [True]


def test_a_failed_save_at_a_file_url_at_world_2_leaves_nothing_visible(tmp_path):
    assert run_ranks(2, interrupted, f"file://{tmp_path}/failed", "data", False) == [True, True]


def test_a_failed_background_save_to_s3_at_world_2_leaves_nothing_visible(s3):
    assert run_ranks(2, interrupted, "s3://ckpts/failed", "data", True, s3) == [True, True]


def recovers(rank, world, root):
    """After a failed save, the next one clears what it left and completes."""
    model, opt = build("zero3")
    checksums.FILE_BYTES = 256
    plain = checksums.write_sums
    fail_on("sums")
    expect_error(["injected"], zf.save_checkpoint, root, model, opt, step=3, error=OSError)
    checksums.write_sums = plain
    store = fsspec.core.url_to_fs(root)[0]
    for _ in range(2):       # the second time written over in place, whole again
        zf.save_checkpoint(root, model, opt, step=4)
        assert sorted(os.path.basename(p) for p in store.ls(root, detail=False)) == \
            ["latest", "step-00000004"]
        assert zf.load_checkpoint(root, model, opt) == {"step": 4}
    return True


def test_the_next_save_clears_a_failed_one():
    assert run_ranks(1, recovers, "memory://recovers") == [True]


def one_process_memory(rank, world):
    model, opt = build("zero1")
    return error_of(zf.save_checkpoint, "memory://mine", model, opt, step=1)


def test_memory_url_at_world_2_is_refused_on_every_rank_before_any_write():
    for message in run_ranks(2, one_process_memory):
        assert "rank 1" in message and "memory:// is one process's own" in message, message


# -- what stays local --------------------------------------------------------------------
def test_paths_the_operating_system_opens_refuse_urls():
    expect_error(['offload("nvme", path=...)', "s3://b/swap", "local"],
                 zf.offload, "nvme", path="s3://b/swap")
    expect_error(["zf.tensorboard(logdir)", "memory://tb"], zf.tensorboard, "memory://tb")
