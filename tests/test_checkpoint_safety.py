"""Loading a checkpoint runs none of its code: crafted pickles in every place a checkpoint
holds one are refused by every load path, on every rank, naming the file and the global,
before any value reaches the model; everything that loaded before still loads."""
from __future__ import annotations

import dataclasses
import importlib.util
import io
import os
import pickle
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import zerofn as zf
import zerofn.deepspeed as deepspeed
from support.errors import error_of
from support.ranks import run_ranks
from zerofn.consolidate import main as consolidate
from zerofn.data.batches import Batches
from zerofn.deepspeed.convert import main as convert_main
from zerofn.io.checkpoint import audit, checksums, extras
from zerofn.train.loop import resume

pytestmark = pytest.mark.multirank

HERE = os.path.dirname(os.path.abspath(__file__))
LEGACY = os.path.join(HERE, "data", "zerofn_checkpoint_fa23d28")
DEEPSPEED = os.path.join(HERE, "data", "deepspeed_checkpoints", "zero1_fp32_w1", "checkpoint")
PLANTED = "PLANTED"        # the file a crafted pickle creates when it is run
GLOBAL = "io.open"         # the global it names (what `open` pickles as)


class Plant:
    """Unpickled, it creates the file ``marker``: what any crafted pickle could do instead."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


@dataclasses.dataclass
class Progress:
    """A user's own extra, of a class no checkpoint holds by default."""
    tokens: int
    phase: str


# -- the checkpoints: a zerofn one and a DeepSpeed engine's, at world 2 ---------------------
def net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def build(seed: int = 0):
    """The tiny ZeRO-3 model, optimizer, scheduler and data position the checkpoints hold."""
    model = net(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = zf.compose(zf.shard_optimizer(), zf.shard_grads(), zf.shard_params())(model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched, Batches(torch.arange(64), seed=1, batch=2, context=4)


def engine_config() -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}


def save_both(rank, world, root):
    model, opt, sched, data = build()
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    sched.step()
    zf.save_checkpoint(f"{root}/zf", model, opt, step=1, sched=sched, data=data,
                       rng=zf.RNGState(), epoch=3)
    engine, *_ = deepspeed.initialize(model=net(0), config=engine_config())
    engine.backward(engine(torch.randn(2, 3)).sum())
    engine.step()
    engine.save_checkpoint(f"{root}/engine", client_state={"epoch": 3})
    return True


# -- crafting: what someone handing over a checkpoint could do ------------------------------
def ckpt_dir(root: str) -> str:
    """The one checkpoint directory under a checkpoint root (zerofn's, or the engine's)."""
    for where, _, files in os.walk(root):
        if ".metadata" in files:
            return where
    raise AssertionError(f"no checkpoint under {root}")


def read_metadata(ckpt: str):
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        return pickle.load(f)          # our own file


def write_metadata(ckpt: str, metadata) -> None:
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)


def saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def replace_entry(ckpt: str, fqn: str, payload: bytes) -> str:
    """Point the first stored piece of ``fqn`` (of a sharded tensor: one rank's) at
    ``payload``, appended to its file; returns the file's path."""
    metadata = read_metadata(ckpt)
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == fqn)
    path = os.path.join(ckpt, info.relative_path)
    offset = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(payload)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload))
    write_metadata(ckpt, metadata)
    return path


def restamp(ckpt: str) -> None:
    """Rewrite the checksums to match the crafted files, as a careful attacker would."""
    sums = {}
    for name in checksums.read_sums(ckpt):
        crc, size = checksums.file_sum(os.path.join(ckpt, name))
        sums[name] = {"size": size, "crc32": crc}
    checksums.write_sums(ckpt, sums)


# The entry each case plants in (the extra: zerofn's blob inside its DCP bytes entry; the
# optimizer's lr: a plain DCP bytes entry), None for .metadata itself.
CASES = {"metadata": None, "extra": "extra.{extra}", "bytes": "optim.param_groups.0.lr",
         "tensor": "model.0.weight"}


def craft(clean_root: str, out_root: str, case: str, fqn: str | None) -> str:
    """A copy of the checkpoint root ``clean_root`` with a planted pickle in the place
    ``case`` names; returns the path of the file that holds it."""
    shutil.copytree(clean_root, out_root)
    ckpt = ckpt_dir(out_root)
    plant = Plant(os.path.join(out_root, PLANTED))
    if case == "metadata":
        metadata = read_metadata(ckpt)
        metadata.storage_meta.save_id = plant
        write_metadata(ckpt, metadata)
        where = os.path.join(ckpt, ".metadata")
    else:
        where = replace_entry(ckpt, fqn, saved(extras.to_bytes(plant) if case == "extra"
                                               else plant))
    restamp(ckpt)
    return where


@pytest.fixture(scope="module")
def crafted(tmp_path_factory):
    """``(clean root, {(kind, case): (crafted root, file holding the plant, its entry)})``
    for kind "zf" (zerofn's save, its extra 'data') and "engine" (the engine's,
    'client_state')."""
    root = str(tmp_path_factory.mktemp("safety"))
    run_ranks(2, save_both, root)
    cases = {}
    for kind, extra in (("zf", "data"), ("engine", "client_state")):
        for case, fqn in CASES.items():
            out, fqn = os.path.join(root, f"{kind}-{case}"), fqn and fqn.format(extra=extra)
            cases[kind, case] = out, craft(os.path.join(root, kind), out, case, fqn), fqn
    return root, cases


def planted(cases: dict) -> list[str]:
    return [out for out, *_ in cases.values() if os.path.exists(os.path.join(out, PLANTED))]


# -- the plants have teeth --------------------------------------------------------------
def test_each_plant_runs_code_when_read_as_torch_reads_it(crafted):
    """Read the plain way (torch's FileSystemReader, torch.load(weights_only=False)), each
    crafted pickle creates its marker: the refusals below refuse something real."""
    _, cases = crafted
    for (kind, case), (out, _, fqn) in cases.items():
        ckpt = ckpt_dir(out)
        metadata = FileSystemReader(ckpt).read_metadata()
        if fqn is not None:
            info = next(s for i, s in metadata.storage_data.items() if i.fqn == fqn)
            with open(os.path.join(ckpt, info.relative_path), "rb") as f:
                f.seek(info.offset)
                value = torch.load(io.BytesIO(f.read(info.length)), weights_only=False)
            if case == "extra":
                torch.load(io.BytesIO(value), weights_only=False)
        assert os.path.exists(os.path.join(out, PLANTED)), (kind, case)
        os.remove(os.path.join(out, PLANTED))


# -- every load path refuses every plant, on every rank -----------------------------------
def state_of(model, opt, sched):
    msd, osd = zf.get_state_dict(model, opt, full=True)
    return msd, osd, sched.state_dict()


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def refused_by_every_path(rank, world, cases):
    """For each crafted checkpoint, each path that loads it: the error it raised here, and
    whether the model, optimizer and scheduler are as they were."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    out = {}
    for case in CASES:
        model, opt, sched, data = build(seed=5)
        before = state_of(model, opt, sched)
        root = cases["zf", case][0]
        out["load_checkpoint", case] = error_of(zf.load_checkpoint, root, model, opt,
                                                sched=sched, data=data, rng=zf.RNGState(),
                                                epoch=None)
        out["zerofn train's resume", case] = error_of(
            resume, SimpleNamespace(resume=True, save_dir=root), model, opt, sched, data, 1)
        out["unchanged", case] = same(before, state_of(model, opt, sched))
        engine, *_ = deepspeed.initialize(model=net(5), config=engine_config())
        before = zf.get_state_dict(engine.module, engine.optimizer, full=True)
        out["engine.load_checkpoint", case] = error_of(engine.load_checkpoint,
                                                       cases["engine", case][0])
        out["engine unchanged", case] = same(
            before, zf.get_state_dict(engine.module, engine.optimizer, full=True))
    return out


def test_every_load_path_refuses_every_plant_on_every_rank(crafted):
    _, cases = crafted
    results = run_ranks(2, refused_by_every_path, cases)
    for rank, found in enumerate(results):
        for case in CASES:
            assert found["unchanged", case] and found["engine unchanged", case], (rank, case)
            for path, kind in (("load_checkpoint", "zf"), ("zerofn train's resume", "zf"),
                               ("engine.load_checkpoint", "engine")):
                message = found[path, case]
                where = cases[kind, case][1]
                assert message is not None, (rank, path, case)
                assert where in message and GLOBAL in message and "trust_class" in message \
                    and "trusted=True" in message, (rank, path, case, message)
    assert planted(cases) == []


def zerofn_train(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerofn", "train", "--nproc", "2", "--model",
                           "tiny", "--context", "16", "--batch", "4", "--eval-batches", "1",
                           "--steps", "2", *flags], capture_output=True, text=True, timeout=300)


@pytest.mark.slow(reason="three zerofn train jobs under torchrun")
def test_zerofn_train_refuses_a_planted_checkpoint_when_it_resumes(tmp_path):
    """The command itself, not only its resume function: a job saves, a plant goes into a
    copy of its checkpoint (.metadata; its data position's extra), the job resumes."""
    done = zerofn_train("--save-dir", str(tmp_path / "clean"))
    assert done.returncode == 0, done.stdout + done.stderr
    for case, fqn in (("metadata", None), ("extra", "extra.data")):
        out = str(tmp_path / case)
        where = craft(str(tmp_path / "clean"), out, case, fqn)
        done = zerofn_train("--save-dir", out, "--resume")
        said = done.stdout + done.stderr
        assert done.returncode != 0 and where in said and GLOBAL in said, said
        assert not os.path.exists(os.path.join(out, PLANTED))


def trainer_resumes(rank, world, root):
    """ZeroTrainer saves at step 1; resuming from a copy with a planted .metadata or
    scheduler extra raises on every rank, and nothing runs."""
    import transformers
    from support.hf_models import build as hf_model
    from zerofn.integrations.transformers import ZeroTrainer
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    data = [{"input_ids": torch.arange(8) + i, "labels": torch.arange(8) + i} for i in range(4)]

    def trainer(out, **kw):
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=1, max_steps=2, report_to=[],
            use_cpu=True, disable_tqdm=True, **kw)
        return ZeroTrainer(model=hf_model("llama"), args=args, train_dataset=data,
                           zerofn=zf.compose(zf.shard_optimizer(), zf.shard_grads(),
                                             zf.shard_params()))

    trainer(f"{root}/clean", save_strategy="steps", save_steps=1).train()
    found = {}
    for case, fqn in (("metadata", None), ("extra", "extra.sched")):
        if rank == 0:
            found[case] = craft(f"{root}/clean/checkpoint-1", f"{root}/{case}", case, fqn)
        dist.barrier()
        found[case, "error"] = error_of(trainer(f"{root}/{case}-out").train,
                                        resume_from_checkpoint=f"{root}/{case}")
    return found


@pytest.mark.slow(reason="transformers' Trainer on two ranks, saving and resuming")
@pytest.mark.hf
def test_zerotrainer_refuses_a_planted_checkpoint_when_it_resumes(tmp_path):
    pytest.importorskip("transformers")
    results = run_ranks(2, trainer_resumes, str(tmp_path), timeout=400)
    for case in ("metadata", "extra"):
        where = results[0][case]
        for rank, found in enumerate(results):
            message = found[case, "error"]
            assert message and where in message and GLOBAL in message, (rank, case, message)
        assert not os.path.exists(tmp_path / case / PLANTED)


def test_consolidate_refuses_plants_in_what_it_reads(crafted, tmp_path, capsys):
    """to-full reads the model's tensors (and .metadata): plants there are refused."""
    _, cases = crafted
    for case in ("metadata", "tensor"):
        out, where, _ = cases["zf", case]
        assert consolidate(["to-full", out, str(tmp_path / f"{case}.safetensors")]) == 1
        err = capsys.readouterr().err
        assert where in err and GLOBAL in err and "--trusted" in err, err
        assert not os.path.exists(tmp_path / f"{case}.safetensors")
    assert planted(cases) == []


def test_to_dcp_refuses_a_planted_pt_file(tmp_path, capsys):
    pt, marker = str(tmp_path / "model.pt"), str(tmp_path / PLANTED)
    torch.save({"w": torch.ones(2), "b": Plant(marker)}, pt)
    assert consolidate(["to-dcp", pt, str(tmp_path / "back")]) == 1
    err = capsys.readouterr().err
    assert pt in err and GLOBAL in err and "--trusted" in err, err
    assert not os.path.exists(marker) and not os.path.exists(tmp_path / "back")


def test_convert_refuses_a_planted_deepspeed_file_and_trusted_runs_none_of_it(tmp_path, capsys):
    source = str(tmp_path / "ds")
    shutil.copytree(DEEPSPEED, source)
    path = os.path.join(source, "global_step3", "mp_rank_00_model_states.pt")
    state = torch.load(path, weights_only=True)       # DeepSpeed's model file: no classes
    marker = str(tmp_path / PLANTED)
    torch.save({**state, "planted": Plant(marker)}, path)
    assert convert_main([source, str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert path in err and GLOBAL in err and "--trusted" in err, err
    assert not os.path.exists(marker) and not os.path.exists(tmp_path / "out")
    # Trusted, the plant is stood in for and dropped: still nothing runs.
    assert convert_main([source, str(tmp_path / "out"), "--trusted"]) == 0
    assert f"client state 'planted' holds {GLOBAL}; dropped" in capsys.readouterr().out
    assert not os.path.exists(marker)


def test_verify_lists_each_plant_without_running_it(crafted, capsys):
    root, cases = crafted
    for kind in ("zf", "engine"):
        assert audit.main([ckpt_dir(os.path.join(root, kind))]) == 0
        said = capsys.readouterr().out
        assert "OK: every file matches its checksum" in said and "model: 4 tensors" in said
    for (kind, case), (out, where, _) in cases.items():
        assert audit.main([ckpt_dir(out)]) == 1
        said = capsys.readouterr().out
        assert f"refused: {where}" in said and GLOBAL in said, said
    assert planted(cases) == []


# -- what loaded before still loads -------------------------------------------------------
def legacy_build():
    spec = importlib.util.spec_from_file_location("make_legacy", os.path.join(LEGACY, "make.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build()


def legacy_loads(rank, world):
    """fa23d28's checkpoint in tests/data, every extra with it, equals its reference."""
    model, opt, sched, loader = legacy_build()
    rng = zf.RNGState()
    loaded = zf.load_checkpoint(f"{LEGACY}/checkpoint", model, opt, sched=sched, loader=loader,
                                rng=rng, epoch=None, notes=None)
    ref = torch.load(f"{LEGACY}/reference.pt")
    assert same((loaded["step"], loaded["epoch"], loaded["notes"]),
                (ref["step"], ref["epoch"], ref["notes"]))
    full = zf.get_state_dict(model, opt, full=True)
    assert same(full[0], ref["model"]) and same(full[1], ref["optim"])
    assert same(sched.state_dict(), ref["sched"]) and same(loader.state_dict(), ref["loader"])
    assert torch.equal(rng.obj.state_dict()["cpu"], ref["rng_cpu"][rank])
    return True


def test_a_checkpoint_from_before_checksums_loads():
    """The checkpoint in tests/data: no checksums, a StatefulDataLoader's state among its
    extras. (FSDP2's checkpoints: tests/test_fsdp2_interop.py.)"""
    pytest.importorskip("torchdata")
    run_ranks(2, legacy_loads)
    assert audit.main([f"{LEGACY}/checkpoint"]) == 0


def plain_and_own_load(rank, world, scratch):
    # A checkpoint torch's own FileSystemWriter wrote, in this torch's version: DCP's own
    # classes in its .metadata, every dtype kind among its entries, no checksums.
    model, opt, sched, data = build(seed=3)
    msd, osd = zf.get_state_dict(model, opt)
    kinds = {"bf16": torch.ones(3, dtype=torch.bfloat16), "i64": torch.arange(3),
             "mask": torch.tensor([True, False]), "u16": torch.ones(2, dtype=torch.uint16)}
    dcp.save({"model": msd, "optim": osd, "kinds": kinds,
              "extra": {"step": extras.to_bytes(4)}},
             storage_writer=FileSystemWriter(f"{scratch}/plain"))
    fresh, fresh_opt, _, _ = build(seed=9)
    assert zf.load_checkpoint(f"{scratch}/plain", fresh, fresh_opt) == {"step": 4}
    assert same(zf.get_state_dict(fresh, fresh_opt, full=True),
                zf.get_state_dict(model, opt, full=True))
    # A user's extra of its own class: refused, then taken once trusted, either way.
    zf.save_checkpoint(f"{scratch}/own", model, opt, step=1, progress=Progress(7, "warmup"))
    message = error_of(zf.load_checkpoint, f"{scratch}/own", model, opt, progress=None)
    assert f"{__name__}.Progress" in message and "extra.progress" in message, message
    taken = zf.load_checkpoint(f"{scratch}/own", model, opt, trusted=True, progress=None)
    assert zf.trust_class(Progress) is Progress
    assert taken == zf.load_checkpoint(f"{scratch}/own", model, opt, progress=None) \
        == {"step": 1, "progress": Progress(7, "warmup")}
    return True


def test_torchs_own_checkpoints_and_a_trusted_users_extra_load(tmp_path):
    """Runs on any torch: here 2.13; on the GPU machines 2.11."""
    run_ranks(2, plain_and_own_load, str(tmp_path))
    assert audit.main([str(tmp_path / "plain")]) == 0


def test_what_zerofn_saves_as_extras_needs_nothing_refused():
    """The step, RNG states, a StatefulDataLoader's and a scheduler's states and plain
    values: inside ENTRY_GLOBALS, as DCP entries and as zerofn's blobs alike."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    from zerofn.io.checkpoint import pickles
    StatefulDataLoader = stateful.StatefulDataLoader
    loader = StatefulDataLoader(list(range(8)), batch_size=2, shuffle=True)
    next(iter(loader))
    model = torch.nn.Linear(2, 2)
    sched = torch.optim.lr_scheduler.OneCycleLR(torch.optim.AdamW(model.parameters()), 1.0,
                                                total_steps=4)
    for value in (7, {"cpu": torch.get_rng_state(), "cuda": []}, loader.state_dict(),
                  sched.state_dict(), {"t": torch.ones(2, dtype=torch.bfloat16), "s": {1},
                                       "b": b"x", "d": torch.float16, "z": 1j}):
        assert pickles.refused_in(io.BytesIO(saved(value))) == []
        assert pickles.refused_in(io.BytesIO(extras.to_bytes(value))) == []


def test_an_enum_pickled_by_name_loads_and_no_other_getattr_does():
    """Python 3.11's first releases (Debian 12's python3, 3.11.2) pickle an enum member as
    ``getattr(its class, its name)``: DCP's metadata then names ``builtins.getattr``, which
    the metadata reader admits for an admitted enum's member alone."""
    import enum
    import io
    import pickle

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from zerofn.io.checkpoint.pickles import Refused, load_metadata
    other = object()

    class AsOldPython(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, enum.Enum):
                return getattr, (type(obj), obj.name)
            if obj is other:
                return getattr, (torch.Size, "mro")
            return NotImplemented

    def pickled(value) -> bytes:
        out = io.BytesIO()
        AsOldPython(out).dump(value)
        return out.getvalue()
    members = list(_MEM_FORMAT_ENCODING)
    assert b"getattr" in pickled(members)
    assert load_metadata(pickled(members), "here") == members
    with pytest.raises(Refused, match="builtins.getattr"):
        load_metadata(pickled([other]), "here")
