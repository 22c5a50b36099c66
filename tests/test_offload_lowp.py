"""offload("cpu", state_dtype=..., master_dtype=...): Adam's moments in bf16 or 8-bit codes
and bf16 masters on the host. What the step computes is checked bit for bit against the
plain-torch reference at world 1; across ranks, stages and checkpoints the fp32 face
(state dicts) is checked, and the training against fp32 state."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import zerofn as zf
from support.compare import worst
from support.errors import expect_error
from support.loops import build_parity, train_reference, train_sharded
from support.models import batches, make_models, make_optimizer
from support.ranks import run_ranks
from zerofn.optim import CPUAdam
from zerofn.optim.lowp import MIN_8BIT_NUMEL
from zerofn.runtime.homes.ring import DEPTH
from zerofn.runtime.runtime import runtime_of

COMBOS = [(torch.int8, torch.float32), (torch.bfloat16, torch.float32),
          (torch.int8, torch.bfloat16), (torch.bfloat16, torch.bfloat16)]


def _lowp(state, master, stage=2, seed=0, **options):
    extra = [zf.offload("cpu", state_dtype=state, master_dtype=master, seed=seed)]
    if master == torch.bfloat16:
        extra.append(zf.mixed_precision(torch.bfloat16))
    return build_parity(stage, "adamw", *extra, seed=seed, **options)


def _train_int8_like_cpu_adam(rank, world):
    """World 1, fp32 masters, int8 moments: the same kernel over the same blocks as
    CPUAdam(state_dtype=int8) on the reference model, so the same values."""
    ref, _ = make_models()
    ref_opt = CPUAdam([p for p in ref.parameters() if p.requires_grad], lr=1e-3,
                      weight_decay=0.1, state_dtype=torch.int8)
    model, opt = _lowp(torch.int8, torch.float32)
    data = batches(3, 1, world)
    train_reference(ref, ref_opt, data)
    train_sharded(model, opt, data, rank, world)
    msd, osd = zf.get_state_dict(model, opt, full=True)
    names = {i: n for i, (n, p) in enumerate((n, p) for n, p in ref.named_parameters()
                                              if p.requires_grad)}
    ref_state = ref_opt.state_dict()["state"]        # (decoded to fp32, torch's format)
    p_err = max(worst(msd[k] - v) for k, v in ref.state_dict().items())
    s_err = max(worst(osd["state"][names[i]][k] - st[k]) for i, st in ref_state.items()
                for k in ("exp_avg", "exp_avg_sq"))
    return p_err, s_err


def test_int8_moments_step_as_cpu_adam_does():
    errors = run_ranks(1, _train_int8_like_cpu_adam)[0]
    assert max(errors) < 1e-5, errors


def _against_fp32(rank, world, stage, state, master):
    """Train with low-precision state and with fp32 state from the same start. Returns
    how far the low-precision run's total update strays from the fp32 one's, and its
    moments from theirs (relative norms), and the dtypes its state dict shows."""
    data = batches(6, 1, world)
    fp32 = build_parity(stage, "adamw", zf.offload("cpu"),
                        *([zf.mixed_precision(torch.bfloat16)] if master != torch.float32 else []))
    lowp = _lowp(state, master, stage)
    start = _flat(zf.get_state_dict(*fp32, full=True)[0])
    train_sharded(*fp32, data, rank, world)
    train_sharded(*lowp, data, rank, world)
    (m32, o32), (ml, ol) = (zf.get_state_dict(m, o, full=True) for m, o in (fp32, lowp))
    update = _rel(_flat(ml) - start, _flat(m32) - start)
    moments = [_rel(ol["state"][n][k], s[k]) for n, s in o32["state"].items()
               for k in ("exp_avg", "exp_avg_sq")]
    dtypes = {t.dtype for s in ol["state"].values() for t in s.values() if t.dim()}
    return update, max(moments), dtypes


def _flat(sd: dict) -> torch.Tensor:
    return torch.cat([v.float().flatten() for v in sd.values()])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# What 6 steps of each stored form stray from fp32 state (relative norms: the total
# update, the worst moment), about twice what was measured: 8-bit codes 0.024 and 0.025,
# bf16 moments 0.002 and 0.006; bf16 masters 0.10 (an update of lr 1e-3 is a fraction of
# a bf16 ulp for most of these weights: stochastic rounding gets it right on average).
STRAY = {(torch.int8, torch.float32): (0.05, 0.05), (torch.bfloat16, torch.float32): (0.005, 0.015),
         (torch.int8, torch.bfloat16): (0.2, 0.1), (torch.bfloat16, torch.bfloat16): (0.2, 0.1)}


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("state,master", COMBOS)
def test_low_precision_state_trains_like_fp32_state_and_shows_fp32(stage, state, master):
    for update, moments, dtypes in run_ranks(2, _against_fp32, stage, state, master):
        assert dtypes == {torch.float32}          # the fp32 face: torch.optim's dtypes
        assert update < STRAY[state, master][0] and moments < STRAY[state, master][1]


def _host_and_nvme(rank, world, path, stage, params):
    """The same stored form on the host and in the swap file: the same state, bit for bit
    (one kernel, one layout of each slot's stored parts, one rounding stream)."""
    data = batches(3, 1, world)
    out = []
    for device in ("cpu", "nvme"):
        options = dict(state_dtype=torch.int8, master_dtype=torch.bfloat16, params=params)
        offload = zf.offload(device, path=path if device == "nvme" else None, **options)
        model, opt = build_parity(stage, "adamw", offload, zf.mixed_precision(torch.bfloat16))
        train_sharded(model, opt, data, rank, world)
        out.append(zf.get_state_dict(model, opt, full=True))
    (ma, oa), (mb, ob) = out
    same_params = all(torch.equal(ma[k], mb[k]) for k in ma)
    same_state = all(torch.equal(oa["state"][n][k], ob["state"][n][k])
                     for n in oa["state"] for k in oa["state"][n])
    return same_params and same_state


@pytest.mark.multirank
@pytest.mark.parametrize("stage,params", [(2, False), (3, False), (3, True)])
def test_nvme_stores_the_same_form_as_the_host(stage, params, tmp_path):
    assert all(run_ranks(2, _host_and_nvme, str(tmp_path), stage, params))


def _swap_bytes(rank, world, path, state, master):
    offload = zf.offload("nvme", path=path, state_dtype=state, master_dtype=master)
    model, opt = build_parity(2, "adamw", offload, zf.mixed_precision(torch.bfloat16))
    return zf.model_state_bytes(model)["nvme"]["optimizer"]


@pytest.mark.multirank
def test_the_swap_file_shrinks_with_the_stored_form(tmp_path):
    """Per element: 12 bytes at fp32; bf16 masters and int8 moments 4 and an fp32 scale per
    256 (small parameters' fp32 moments, and the layout's alignment, on top)."""
    fp32, lowp = (run_ranks(2, _swap_bytes, str(tmp_path), *dtypes)[0]
                  for dtypes in ((torch.float32, torch.float32), (torch.int8, torch.bfloat16)))
    assert lowp < 0.5 * fp32, (lowp, fp32)


def _resume(rank, world, path, how, state):
    """4 steps of bf16 masters and ``state`` moments: "through", or the last 2 after
    loading the checkpoint "save" wrote after the first 2 (at world 2); returns the model
    and optimizer state (and where "save" wrote, what dtypes the checkpoint holds)."""
    data = batches(4, 1, 2)
    model, opt = _lowp(state, torch.bfloat16)
    if how == "load":
        zf.load_checkpoint(path, model, opt)
    train_sharded(model, opt, data[:2] if how == "save" else data[2:] if how == "load"
                  else data, rank, world)
    disk = None
    if how == "save":
        saved = zf.save_checkpoint(path, model, opt, step=2)
    if how == "save" and rank == 0:       # (rank 0 publishes the checkpoint it finished)
        meta = dcp.FileSystemReader(saved).read_metadata()
        disk = {k: m.properties.dtype for k, m in meta.state_dict_metadata.items()
                if hasattr(m, "properties")}
    msd, osd = zf.get_state_dict(model, opt, full=True)
    moments = {f"{n}.{k}": t for n, st in osd["state"].items() for k, t in st.items()
               if k != "step"}
    return {k: v.float() for k, v in {**msd, **moments}.items()}, disk


def _resumes(rank, world, root, runs):
    """``_resume`` for each (how, state) of ``runs`` in one launch, a folder a state."""
    return [_resume(rank, world, f"{root}/{str(state)[6:]}", how, state) for how, state in runs]


RESUMED = [torch.int8, torch.bfloat16]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """{state: rank 0's runs}: "through" and "save" at world 2 (one launch for both states),
    then the checkpoint loaded at world 2 (one) and at world 1 (one)."""
    root = str(tmp_path_factory.mktemp("resumed"))
    first = run_ranks(2, _resumes, root, [(how, state) for state in RESUMED
                                          for how in ("through", "save")])[0]
    loads = [("load", state) for state in RESUMED]
    at_2, at_1 = (run_ranks(world, _resumes, root, loads)[0] for world in (2, 1))
    return {state: dict(through=first[2 * i][0], disk=first[2 * i + 1][1],
                        resumed=at_2[i][0], one=at_1[i][0]) for i, state in enumerate(RESUMED)}


@pytest.mark.parametrize("state", RESUMED)
def test_a_resumed_run_is_the_run_bit_for_bit_and_reshards(state, resumed):
    """The checkpoint holds bf16 masters and bf16 moments in bf16, 8-bit ones in fp32 (the
    codes times their scales); loading encodes them back to the very codes and bf16
    values, and the rounding streams follow the step: bit for bit at the same world."""
    through, disk = resumed[state]["through"], resumed[state]["disk"]
    moments = torch.bfloat16 if state == torch.bfloat16 else torch.float32
    assert disk["model.tok.weight"] == disk["model.pos.weight"] == torch.bfloat16   # masters
    assert disk["optim.state.tok.weight.exp_avg"] == moments, disk
    assert disk["optim.state.tok.weight.exp_avg_sq"] == moments, disk
    assert disk["model.temperature"] == torch.float32                   # (a buffer)
    assert all(torch.equal(through[k], resumed[state]["resumed"][k]) for k in through)
    one = resumed[state]["one"]
    # (world 1 draws other rounding streams than world 2's shards: equal to bf16's ulp)
    assert max((through[k] - one[k]).abs().max().item() for k in msd_keys(through)) < 2e-2


def msd_keys(state: dict) -> list[str]:
    return [k for k in state if not k.endswith(("exp_avg", "exp_avg_sq"))]


def _across_stages(rank, world, path, stage):
    """Saved by 8-bit ZeRO-2 at world 2; loaded by 8-bit ZeRO-``stage`` (here at world 1):
    the same fp32 face of the state."""
    model, opt = _lowp(torch.int8, torch.float32, stage=stage)
    if world == 2:
        train_sharded(model, opt, batches(2, 1, world), rank, world)
        zf.save_checkpoint(path, model, opt, step=2)
    else:
        zf.load_checkpoint(path, model, opt)
    return zf.get_state_dict(model, opt, full=True)


def test_an_8_bit_checkpoint_moves_across_stages_and_world_sizes(tmp_path):
    """The masters arrive exactly; the moments are encoded once more, in the blocks of the
    new layout (a rank's rows of each parameter), so within the codes' rounding."""
    path = str(tmp_path / "ckpt")
    (msd, osd) = run_ranks(2, _across_stages, path, 2)[0]
    for stage in (2, 3):
        lmsd, losd = run_ranks(1, _across_stages, path, stage)[0]
        assert all(torch.equal(msd[k], lmsd[k]) for k in msd), stage
        for name, state in osd["state"].items():
            for k in ("exp_avg", "exp_avg_sq"):
                a, b = state[k], losd["state"][name][k]
                assert ((a - b).norm() / a.norm().clamp_min(1e-30)).item() < 0.05, (stage, name, k)


def _state_dict_round_trip(rank, world):
    """A state-dict access decodes and encodes back; nothing changes, bit for bit."""
    model, opt = _lowp(torch.int8, torch.bfloat16)
    train_sharded(model, opt, batches(2, 1, world), rank, world)
    off = runtime_of(model).homes
    before = [t.clone() for t in off.state_buffers()]
    msd, osd = zf.get_state_dict(model, opt)
    zf.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    runtime_of(model).refresh_params()
    return all(torch.equal(a, b) for a, b in zip(before, off.state_buffers()))


@pytest.mark.multirank
def test_loading_its_own_state_dict_leaves_the_stored_state_as_it_was():
    assert all(run_ranks(2, _state_dict_round_trip))


def _fp32_to_int8_and_back(rank, world, path):
    data = batches(3, 1, world)
    fp32 = build_parity(2, "adamw", zf.offload("cpu"))
    train_sharded(*fp32, data, rank, world)
    zf.save_checkpoint(path + "/a", *fp32, step=3)
    int8 = _lowp(torch.int8, torch.float32)
    zf.load_checkpoint(path + "/a", *int8)
    zf.save_checkpoint(path + "/b", *int8, step=3)
    back = build_parity(2, "adamw", zf.offload("cpu"))
    zf.load_checkpoint(path + "/b", *back)
    a, b = (zf.get_state_dict(*m, full=True)[1]["state"] for m in (fp32, back))
    return max(((a[n][k] - b[n][k]).norm() / a[n][k].norm().clamp_min(1e-30)).item()
               for n in a for k in ("exp_avg", "exp_avg_sq"))


@pytest.mark.multirank
def test_an_fp32_checkpoint_loads_into_int8_state_and_back(tmp_path):
    for rel in run_ranks(2, _fp32_to_int8_and_back, str(tmp_path)):
        assert 0 < rel < 0.05, rel     # the 8-bit codes' rounding, once


def _host_bytes(rank, world, state, master):
    model, opt = _lowp(state, master)
    train_sharded(model, opt, batches(1, 1, world), rank, world)
    rt = runtime_of(model)
    slots = [s for u in rt.units for s in u.slots]
    big = [s for s in slots if s.numel >= MIN_8BIT_NUMEL]
    return (zf.model_state_bytes(model)["host"], sum(u.shard_numel for u in rt.units),
            sum(s.local_numel for s in slots), sum(-(-s.local_numel // 256) for s in big),
            sum(s.local_numel for s in slots if s not in big), sum(s.requires_grad for s in slots),
            max(u.shard_numel for u in rt.units))


@pytest.mark.multirank
@pytest.mark.parametrize("state,master", COMBOS)
def test_model_state_bytes_counts_the_stored_form(state, master):
    """Host bytes per element of the shard: masters 4 or 2, each moment 1 (and an fp32
    scale per 256; small parameters 4) or 2; the gradients pass through the host ring, its
    slots each the largest unit's shard in the reduce dtype, in whole 256-byte lines; no
    compute copy (bf16 masters are the compute rows; fp32 ones here compute in fp32).
    (fp32 masters count as the optimizer's parameters, their rows without the layout's
    padding.)"""
    host, shard, rows, blocks, small, trainable, largest = run_ranks(2, _host_bytes, state,
                                                                     master)[0]
    # (int8: codes for the whole shard, then an fp32 scale per block of the parameters of
    # 4096 elements or more, and fp32 moments for the smaller ones)
    moments = 2 * shard + 8 * blocks + 8 * small if state == torch.int8 else 4 * shard
    expected = (2 * shard if master == torch.bfloat16 else 4 * rows) + moments
    steps = 4 * (trainable + 1)                  # each parameter's step count, a stand-in
    assert expected <= host["optimizer"] <= expected + steps, (host, expected)
    reduced = 2 if master == torch.bfloat16 else 4
    assert host["grads"] == DEPTH * -(-largest * reduced // 256) * 256
    assert host["params"] == 0


def _refused(rank, world, kind, state, master, fragments):
    _, model = make_models()
    opt = make_optimizer(kind, model.parameters())
    offload = zf.offload("cpu", state_dtype=state, master_dtype=master)
    expect_error(fragments, lambda: zf.compose(zf.shard_optimizer(), offload)(model, opt))


@pytest.mark.parametrize("kind,state,master,fragments", [
    ("sgd", torch.int8, torch.float32, ["CPU Adam", "SGD"]),
    ("adamw", torch.float32, torch.bfloat16, ["bf16 masters", "mixed_precision"]),
])
def test_combinations_that_cannot_work_are_refused(kind, state, master, fragments):
    run_ranks(1, _refused, kind, state, master, fragments)


def test_the_options_are_checked_where_they_are_given():
    expect_error(["state_dtype", "torch.int8"], zf.offload, "cpu", state_dtype=torch.float16)
    expect_error(["master_dtype"], zf.offload, "cpu", master_dtype=torch.int8)
