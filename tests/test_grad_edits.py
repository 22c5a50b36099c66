"""What a loop does to ``p.grad`` between backward and ``step()`` is what the step uses, at
every stage and placement, as in plain PyTorch; or, where the host already stepped a unit
during backward (overlap_step), ``step()`` refuses it on every rank (visible.py's [Note:
gradients as a loop sees them])."""
from __future__ import annotations

import tempfile

import pytest
import torch
from torch.distributed.tensor import DTensor

import zerofn as zf
from zerofn.runtime import runtime_of
from support.compare import TOL, max_errors
from support.loops import zero
from support.models import batches, make_models, make_optimizer
from support.offload import offload_transform
from support.ranks import run_ranks

pytestmark = pytest.mark.multirank

STEPS = 3
ZEROED = "blocks.0.attn.qkv.weight"    # the parameter "zero_one" zeroes


def clip_norm(model):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


def clip_value(model):
    torch.nn.utils.clip_grad_value_(model.parameters(), 2e-3)


def scale(model):
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(0.5)


def zero_one(model):
    dict(model.named_parameters())[ZEROED].grad.zero_()


def replace(model):
    """A new tensor in ``p.grad`` rather than an edit in place."""
    p = dict(model.named_parameters())["blocks.1.fc.weight"]
    p.grad = p.grad * 3


def _matrices(model):
    """This rank's rows of each 2-D gradient: whole rows under Shard(0), so an edit made
    row by row is the same edit as plain PyTorch's on the whole gradient."""
    for p in model.parameters():
        if p.grad is not None and p.grad.dim() == 2:
            yield p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad


def flip_balanced(model):
    """In each row, the pair of neighbouring values of opposite signs whose smaller is
    largest swaps its signs: a sum of the rows' bits does not change. (The edit is chosen
    far from any value rounding could tip, or Adam would make a tipped choice of plain
    PyTorch's against zerofn's a step of lr.)"""
    for g in _matrices(model):
        a, b = g[:, 0::2], g[:, 1::2]       # (the parity model's widths are even)
        score = torch.where(a * b < 0, torch.minimum(a.abs(), b.abs()), 0)
        best, col = score.max(1)
        rows = (best > 1e-6).nonzero().squeeze(1)
        a[rows, col[rows]] *= -1
        b[rows, col[rows]] *= -1


def permute_columns(model):
    for g in _matrices(model):
        g.copy_(g[:, torch.randperm(g.shape[1], generator=torch.Generator().manual_seed(0))])


def swap_two_columns(model):
    for g in _matrices(model):
        g.copy_(g[:, [1, 0, *range(2, g.shape[1])]])


def add_then_subtract(model):
    """0.1 is not representable: the values come back rounded, not as they were."""
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            g.add_(0.1).sub_(0.1)


EDITS = {f.__name__: f for f in (clip_norm, clip_value, scale, zero_one, replace,
                                   flip_balanced, permute_columns, swap_two_columns,
                                   add_then_subtract)}

# (stage, offload options or None): no offload, the host (its ring), the device's share
# (ratio), NVMe and parameter offload (gradients copied to the host during backward).
PLACEMENTS = [(s, o) for s in (1, 2, 3) for o in (None, {}, {"offload_ratio": 0.5})] + [
    (3, {"nvme": True}), (3, {"offload_params": True})]
OVERLAPPED = [(2, {"overlap_step": True}), (3, {"overlap_step": True})]


def edited_run(rank, world, stage, offload, edit):
    """The parity model trained with ``edit`` applied to the gradients before each step,
    under zerofn and in plain PyTorch on the global batch: their distance, or the error
    step() raised."""
    ref, model = make_models()
    ref_opt = make_optimizer("adamw", ref.parameters())
    opt = make_optimizer("adamw", model.parameters())
    with tempfile.TemporaryDirectory() as path:
        extra = []
        if offload is not None:
            opts = {k.removeprefix("offload_"): v for k, v in offload.items()}
            extra.append(offload_transform(dict(opts, path=path)))
        model, opt = zf.compose(zero(stage), *extra)(model, opt)
        data = batches(STEPS, 1, world)
        for [(x, y)] in data:
            ref(x, y).backward()
            EDITS[edit](ref)
            ref_opt.step()
            ref_opt.zero_grad()
            model(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
            EDITS[edit](model)
            try:
                opt.step()
            except ValueError as e:
                return "refused", str(e)
            opt.zero_grad()
        return "trained", max_errors(ref, ref_opt, model, opt)


def edit_matrix(rank, world, configs):
    return [edited_run(rank, world, *c) for c in configs]


@pytest.mark.parametrize("world", [1, 2])
def test_every_edit_of_p_grad_is_what_the_step_uses(world):
    configs = [(s, o, e) for s, o in PLACEMENTS for e in EDITS]
    for rank, results in enumerate(run_ranks(world, edit_matrix, configs, timeout=900)):
        for config, (what, detail) in zip(configs, results):
            assert what == "trained", (world, rank, config, detail)
            p_err, s_err = detail
            assert p_err < TOL and s_err < TOL, (world, rank, config, p_err, s_err)


def test_an_edit_after_the_host_stepped_during_backward_is_refused_on_every_rank():
    configs = [(s, o, e) for s, o in OVERLAPPED for e in EDITS]
    for rank, results in enumerate(run_ranks(2, edit_matrix, configs, timeout=600)):
        for config, (what, detail) in zip(configs, results):
            assert what == "refused", (rank, config, detail)
            assert "overlap_step=True" in detail and "after backward" in detail, detail


def one_rank_edits(rank, world):
    """Only rank 1's loop edits: rank 0 must refuse too (the vote carries the verdict),
    not wait in a collective rank 1 never joins."""
    _, model = make_models()
    opt = make_optimizer("adamw", model.parameters())
    model, opt = zf.compose(zero(2), zf.offload("cpu", overlap_step=True))(model, opt)
    [(x, y)] = batches(1, 1, world)[0]
    model(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
    if rank == 1:
        scale(model)
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return None


def test_one_ranks_edit_under_overlap_step_stops_every_rank():
    errors = run_ranks(2, one_rank_edits)
    assert all(e is not None for e in errors), errors
    assert "'blocks" in errors[1] or "unit" in errors[1]
    assert "another rank" in errors[0], errors[0]


def grads_as_seen(rank, world, stage):
    """What p.grad holds after backward: its type and placements, and that it aliases the
    rows the step reads (an edit shows in the reduced shard)."""
    _, model = make_models()
    opt = make_optimizer("adamw", model.parameters())
    model, opt = zero(stage)(model, opt)
    [(x, y)] = batches(1, 1, world)[0]
    model(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
    kinds = {type(p.grad).__name__ for p in model.parameters() if p.requires_grad}
    frozen = [p.grad for p in model.parameters() if not p.requires_grad]
    p = dict(model.named_parameters())["blocks.1.fc.weight"]
    local = p.grad.to_local()
    rt = runtime_of(model)
    slot = rt.slots_by_name()["blocks.1.fc.weight"]
    unit = next(u for u in rt.units if slot in u.slots)
    before = rt.reducer.grad_of(unit, slot).clone()
    p.grad.mul_(2)
    after = rt.reducer.grad_of(unit, slot)
    aliased = torch.equal(after, before * 2) and local.data_ptr() == after.data_ptr()
    shape = tuple(p.grad.shape) == tuple(p.shape)
    placements = [repr(pl) for pl in p.grad.placements]
    # torch's zero_grad reaches the optimizer's gradients at once, the model's views at
    # the next forward (visible.py's [Note: the optimizer's markers]); the model's own
    # zero_grad clears them at once.
    opt.zero_grad()
    with torch.no_grad():
        model(x.chunk(world)[rank], y.chunk(world)[rank])
    cleared = all(q.grad is None for q in model.parameters())
    model(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
    model.zero_grad()
    cleared = cleared and all(q.grad is None for q in model.parameters())
    return kinds, frozen, aliased, shape, placements, cleared


STAGES = [1, 2, 3]


def each_stage(rank, world, fn, *args):
    """{stage: fn(rank, world, stage, *args)} for every stage of STAGES, in one launch."""
    return {stage: fn(rank, world, stage, *args) for stage in STAGES}


@pytest.fixture(scope="module")
def seen_grads():
    return run_ranks(2, each_stage, grads_as_seen)


@pytest.mark.parametrize("stage", STAGES)
def test_p_grad_is_a_shard_view_of_the_reduced_rows_as_fsdp2_shows_it(seen_grads, stage):
    for kinds, frozen, aliased, shape, placements, cleared in (r[stage] for r in seen_grads):
        assert kinds == {DTensor.__name__}
        assert frozen == [None]
        assert aliased and shape and placements == ["Shard(dim=0)"] and cleared


def torch_clip_against_zerofn(rank, world, stage, accum):
    """torch's clip_grad_norm_ on model.parameters() returns zerofn's own norm, and the run
    it clips equals zf.clip_grad_norm_'s, with accumulation (no no_sync: each backward
    reduces, and the shards add up)."""
    out = []
    for use_torch in (True, False):
        _, model = make_models()
        opt = make_optimizer("adamw", model.parameters())
        model, opt = zero(stage)(model, opt)
        norms = []
        for micro in batches(STEPS, accum, world):
            for x, y in micro:
                (model(x.chunk(world)[rank], y.chunk(world)[rank]) / accum).backward()
            if use_torch:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).full_tensor()
            else:
                norm = zf.clip_grad_norm_(model, 0.05)
            norms.append(float(norm))
            opt.step()
            opt.zero_grad()
        from zerofn.state_dict import get_model_state_dict
        out.append((norms, get_model_state_dict(model, full=True)))
    (tn, tw), (zn, zw) = out
    return max(abs(a - b) / b for a, b in zip(tn, zn)), max((tw[k] - zw[k]).abs().max().item()
                                                            for k in tw)


@pytest.fixture(scope="module")
def clipped():
    return run_ranks(2, each_stage, torch_clip_against_zerofn, 2)


@pytest.mark.parametrize("stage", STAGES)
def test_torchs_clip_returns_zerofns_norm_and_clips_the_same(clipped, stage):
    for norm_err, weight_err in (r[stage] for r in clipped):
        assert norm_err < 1e-6 and weight_err < TOL, (norm_err, weight_err)


SHAPES = {"sign flip, balanced": lambda r: r.copy_(torch.where(
              torch.arange(r.numel()) < 2, -r, r)),          # one positive, one negative
          "permutation": lambda r: r.copy_(r.flip(0)),
          "swap of two": lambda r: r.copy_(r[[1, 0, *range(2, r.numel())]]),
          "add then subtract": lambda r: r.add_(0.1).sub_(0.1)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_the_fingerprint_sees_every_edit_shape_and_cpp_and_torch_agree(dtype, monkeypatch):
    """The edit detector's fingerprint changes under every edit shape a loop makes, where a
    sum of the bits did not (a permutation, a balanced sign flip); the C++ (a CPU's rows)
    and torch's (a GPU's) give the same number over any number of chunks, and torch's asks
    for no temporary of more than a chunk (one of 8 bytes an element fragmented a CPU's
    heap step after step)."""
    from zerofn.runtime import visible
    rows = torch.randn(3 * visible.FINGERPRINT_CHUNK + 7).to(dtype)
    rows[:2] = torch.tensor([1.5, -2.5])
    before = visible.fingerprint(rows)
    assert before == visible._fingerprint_torch(rows)
    assert visible.fingerprint(rows[:0]) == visible._fingerprint_torch(rows[:0]) == 0
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}[rows.element_size()]
    for shape, edit in SHAPES.items():
        edited = edit(rows.clone())
        assert not torch.equal(edited.view(bits), rows.view(bits)), shape
        assert visible.fingerprint(edited) != before, shape
        assert visible.fingerprint(edited) == visible._fingerprint_torch(edited), shape
    bit_sum = lambda r: r.view(bits).long().sum()
    assert bit_sum(SHAPES["permutation"](rows.clone())) == bit_sum(rows)   # what it missed
    widest = []
    real_sum = torch.Tensor.sum

    def watched(t, *a, **k):
        widest.append(t.numel())
        return real_sum(t, *a, **k)
    monkeypatch.setattr(torch.Tensor, "sum", watched)
    visible._fingerprint_torch(rows)
    assert max(widest) <= visible.FINGERPRINT_CHUNK
