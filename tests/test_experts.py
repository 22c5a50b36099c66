"""A mixture of experts that expert parallelism split (each rank owns some experts, tokens
travel to them by all-to-all) shards under zerofn with ``groups=``: the experts over the
expert-data-parallel mesh, the dense weights over the whole data-parallel one, as FSDP2's
per-module mesh (torchtitan's apply_moe_ep_tp). World 4 as ``(edp=2, ep=2)``: each config
trains as one process holding every expert does, each rank holds a quarter of the
experts' optimizer state, and what zerofn cannot do is refused on every rank."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import zerofn as zf
from support.compare import full_state, max_error, worst
from support.errors import error_of
from support.loops import zero
from support.moe_models import (PATTERN, expert_parallel, expert_parallel_meta, moe_batches,
                                moe_mesh, own_part, reference)
from support.ranks import run_ranks

pytestmark = pytest.mark.multirank

STEPS, ACCUM, CLIP, TOL = 4, 2, 0.5, 1e-6
# Adam's lr 1e-4: Adam divides each gradient by its own magnitude, so the order the ranks'
# gradients are summed in moves the weights by about lr x 3e-3 in a hand-written EP + DP
# loop without zerofn too (2.9e-5 at lr 1e-2, 2.9e-6 at 1e-3, 3.6e-7 at 1e-4).
LR = {"adamw": 1e-4, "sgd": 0.1}


def optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR[kind], momentum=0.9)
    return torch.optim.AdamW(params, lr=LR[kind])


def experts_zerofn(mesh, stage: int, kind: str, extra=(), seed: int = 0):
    """The expert-parallel model under ZeRO-``stage``: dense weights over mesh["dp"], the
    experts over mesh["edp"] (the optimizer built after, FSDP2's order)."""
    model = zf.compose(zero(stage, group=mesh["dp"], groups={PATTERN: mesh["edp"]}),
                       *extra)(expert_parallel(mesh, seed))
    return model, optimizer(kind, model.parameters())


def train_reference(kind: str, data):
    """The reference trained; and its gradients' norm at each step."""
    ref = reference()
    opt = optimizer(kind, ref.parameters())
    norms = []
    for micro in data:
        for x, choice, y in micro:
            (ref(x, choice, y) / len(micro)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
    return ref, opt, norms


def train_ranks(model, opt, data, mesh):
    """Each data-parallel rank its share of every global batch, the micro-batches
    accumulated, the global norm clipped; returns the norm at each step."""
    dp, rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    norms = []
    for micro in data:
        for x, choice, y in micro:
            mine = (t.chunk(dp)[rank] for t in (x, choice, y))
            (model(*mine) / len(micro)).backward()
        norms.append(zf.clip_grad_norm_(model, CLIP).item())
        opt.step()
        opt.zero_grad()
    return norms


def state_bytes(state: dict, experts: bool = True, counters: bool = False) -> int:
    """Bytes of the optimizer state tensors (local pieces of a sharded state dict's
    DTensors): the experts' only where ``experts``; the step counters only where
    ``counters``, else the rest."""
    return sum((v.to_local() if isinstance(v, DTensor) else v).nbytes
               for fqn, st in state.items() if ".moe.experts." in fqn or not experts
               for v in st.values() if torch.is_tensor(v) and (v.dim() == 0) == counters)


def steps(n: int, dp: int) -> list:
    """``n`` steps of ``ACCUM`` micro-batches each."""
    micro = moe_batches(n * ACCUM, dp)
    return [micro[i:i + ACCUM] for i in range(0, len(micro), ACCUM)]


def _every_parity(rank, world, tmp):
    """``_parity`` of every config, one after another on the same ranks, each optimizer's
    reference trained once."""
    mesh = moe_mesh()
    data = steps(STEPS, mesh["dp"].size())
    refs = {kind: train_reference(kind, data) for kind in LR}
    return {name: _parity(mesh, data, refs[kind], stage, kind, offload, tmp)
            for name, (stage, kind, offload) in CONFIGS.items()}


def _parity(mesh, data, reference_run, stage, kind, offload, tmp):
    extra = {None: [], "cpu": [zf.offload("cpu")], "nvme": [zf.offload("nvme", path=tmp)]}
    model, opt = experts_zerofn(mesh, stage, kind, extra[offload])
    norms = train_ranks(model, opt, data, mesh)
    stats = zf.comm_stats(model)     # the experts' own group's collectives, apart
    assert stats[f"{PATTERN}.reduce_scatter"] > 0 and stats["reduce_scatter"] > 0, stats
    ref, ref_opt, ref_norms = reference_run
    full, _ = zf.get_state_dict(model, opt, full=True)
    mine = own_part(ref.state_dict(), model)
    assert full.keys() == mine.keys()
    _, sharded = zf.get_state_dict(model, opt)
    names = {p: n for n, p in ref.named_parameters()}
    ref_state = {names[p]: st for p, st in ref_opt.state.items()}
    # zerofn's own count: the moments of every parameter over 4, and this rank's counters.
    held = zf.model_state_bytes(model)["cpu"]["optimizer"]
    whole = state_bytes(ref_state, False) / 4 + state_bytes(sharded["state"], False, True)
    return (max(worst(full[k] - v) for k, v in mine.items()),
            max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
            None if offload else held - whole,
            state_bytes(sharded["state"]), state_bytes(ref_state),
            {k: str(v.device_mesh.mesh_dim_names) for k, v in sharded["state"][
                "blocks.0.moe.experts.experts." + f"{2 * mesh['ep'].get_local_rank()}.weight"
            ].items() if isinstance(v, DTensor)})


CONFIGS = {"zero1-adamw": (1, "adamw", None), "zero2-adamw": (2, "adamw", None),
           "zero3-adamw": (3, "adamw", None), "zero3-sgd": (3, "sgd", None),
           "zero3-offload-cpu-adamw": (3, "adamw", "cpu"),
           "zero3-offload-nvme-adamw": (3, "adamw", "nvme")}


@pytest.mark.parametrize("config", CONFIGS)
def test_experts_train_as_one_process(config, shared_runs, nvme_dir):
    """Weights within 1e-6 of one process holding every expert after 4 clipped steps of 2
    accumulated micro-batches (the
    global norm the same to 1e-6: every expert row counted once across ep x edp, the
    experts' gradients averaged over the global batch), and each rank holds exactly
    1/(ep x edp) of the experts' optimizer state (SGD's momentum, Adam's moments), its
    DTensors on the expert-data-parallel mesh; without offload ``zf.model_state_bytes``
    counts a quarter of the whole model's, with this rank's step counters. (Every config
    from one run of the ranks: ``_every_parity``.)"""
    out = [by_config[config] for by_config in shared_runs(4, _every_parity, nvme_dir)]
    for rank, (err, norm_err, extra_bytes, mine, total, meshes) in enumerate(out):
        assert err <= TOL and norm_err <= TOL, (rank, err, norm_err)
        assert extra_bytes in (0, None), (rank, extra_bytes)
        assert mine * 4 == total > 0, (rank, mine, total)
        assert meshes and set(meshes.values()) == {"('edp',)"}, meshes
    print({config: {"weights": [o[0] for o in out], "norm": [o[1] for o in out],
                    "expert state bytes (rank, all)": [o[3:5] for o in out]}})


def _every_refusal(rank, world):
    """Each case's refusal, one after another on the same ranks (each refused before any
    collective, so the next case finds every rank where it started)."""
    mesh = moe_mesh()
    return {case: _refusal(mesh, case) for case in REFUSALS}


def _refusal(mesh, case):
    groups = {PATTERN: mesh["edp"]}
    group = mesh["dp"]
    if case == "no module":
        groups = {"blocks.*.moe.expert": mesh["edp"]}
    elif case == "no forward":
        groups = {"blocks.*.moe.experts.experts": mesh["edp"]}
    elif case == "another root":
        groups = {PATTERN: init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))["a"]}
    elif case == "2-D":
        groups = {PATTERN: mesh["root"]}
    elif case == "hybrid":
        group = mesh["root"]    # (edp, ep) read as (replicate, shard)
    model = expert_parallel(mesh)
    if case == "meta":
        model = model.to("meta")
    if case == "DTensor experts":
        expert = model.blocks[0].moe.experts.experts[str(2 * mesh["ep"].get_local_rank())]
        expert.weight = torch.nn.Parameter(DTensor.from_local(expert.weight.detach(),
                                                              mesh["ep"], [Shard(0)]))
    if case == "save_pretrained":
        model = zf.shard_params(group=group, groups=groups)(model)
        return error_of(zf.save_pretrained, model, "unwritten")
    if case == "whole-tensor optimizer":
        opt = torch.optim.Adafactor(model.parameters())
        return error_of(zf.shard_params(group=group, groups=groups), model, opt)
    if case == "full_weights":
        model = zf.shard_params(group=group, groups=groups)(model)
        return error_of(lambda: next(zf.full_weights(model)))
    return error_of(zf.shard_params(group=group, groups=groups), model)


REFUSALS = {"no module": "matches no module",
            "no forward": "has no forward",
            "another root": "take both from the same init_device_mesh",
            "2-D": "a dict of module names or patterns to 1-D DeviceMeshes",
            "hybrid": "with hybrid sharding",
            "DTensor experts": "is a DTensor (tensor parallelism, or experts split",
            "save_pretrained": "save with zf.save_checkpoint",
            "full_weights": "experts yourself, or save with zf.save_checkpoint",
            "whole-tensor optimizer": "give the experts to an elementwise optimizer",
            "meta": "would start equal to another's"}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals(case, shared_runs):
    """Each refused on every rank, before any collective (a rank that went on would leave
    the others waiting). (Every case from one run of the ranks: ``_every_refusal``.)"""
    said = [by_case[case] for by_case in shared_runs(4, _every_refusal)]
    assert all(s is not None and REFUSALS[case] in s for s in said), said


def _checkpoint(rank, world, root):
    """ZeRO-3 saves after 2 steps; a fresh expert-parallel model loads it at ZeRO-3 and at
    ZeRO-1 (the same layout); returns each load's gap from the saved state."""
    mesh = moe_mesh()
    data = steps(2, mesh["dp"].size())
    model, opt = experts_zerofn(mesh, 3, "adamw")
    train_ranks(model, opt, data, mesh)
    zf.save_checkpoint(root, model, opt, step=2)
    saved = full_state(model, opt)
    gaps = []
    for stage in (3, 1):
        fresh, fresh_opt = experts_zerofn(mesh, stage, "adamw", seed=7)
        zf.load_checkpoint(root, fresh, fresh_opt)
        gaps.append(max_error(full_state(fresh, fresh_opt), saved))
    return gaps, saved


def _whole(rank, world, root):
    """The checkpoint into one process holding every expert (a plain model), or at
    another layout, ``(edp=4, ep=1)``: every rank holds every expert, sharded 4 ways."""
    if world == 1:
        model = reference(seed=7)
        opt = optimizer("adamw", model.parameters())
    else:
        model, opt = experts_zerofn(moe_mesh(4, 1), 3, "adamw", seed=7)
    zf.load_checkpoint(root, model, opt)
    return full_state(model, opt)


def test_checkpoint_round_trips(tmp_path):
    """The experts' state is saved as DTensors on the expert-data-parallel mesh, each
    expert under its own name: it loads back exactly at the same layout, whole into one
    process holding every expert, and at (edp=4, ep=1)."""
    out = run_ranks(4, _checkpoint, str(tmp_path), timeout=300)
    assert all(gaps == [0.0, 0.0] for gaps, _ in out), [g for g, _ in out]
    whole = run_ranks(1, _whole, str(tmp_path), timeout=300)[0]
    assert max_error(run_ranks(4, _whole, str(tmp_path), timeout=300)[0], whole) == 0.0
    for _, (params, optim) in out:   # each rank's part of the whole
        assert all(torch.equal(whole[0][k], v) for k, v in params.items())
        for fqn, st in optim["state"].items():
            assert all(torch.equal(torch.as_tensor(whole[1]["state"][fqn][k]),
                                   torch.as_tensor(v)) for k, v in st.items()), fqn
    assert len(whole[1]["state"]) == sum(1 for _ in reference().parameters())


def _synced(rank, world):
    """Each rank builds its part of another model (seeded by its rank); set-up keeps rank
    0's dense weights and, for each expert, its first ``edp`` rank's (the ranks of one
    ``ep`` position hold the same experts, the others others)."""
    mesh = moe_mesh()
    model, _ = experts_zerofn(mesh, 1, "adamw", seed=rank)
    dense = reference(0).state_dict()
    experts = reference(mesh["ep"].get_local_rank()).state_dict()   # (edp 0's global rank)
    return all(torch.equal(v, (experts if ".moe.experts." in k else dense)[k])
               for k, v in model.state_dict().items())


def test_set_up_broadcasts_dense_weights_over_dp_and_experts_over_edp():
    assert run_ranks(4, _synced) == [True] * 4


def seeded_init(model: torch.nn.Module):
    """An init for ``model``'s Linears that draws each from a seed of its own name (the
    expert's global index in it): the same weights on whichever rank holds it."""
    names = {m: n for n, m in model.named_modules()}

    def init(module):
        if isinstance(module, torch.nn.Linear):
            torch.manual_seed(sum(map(ord, names[module])))
            module.reset_parameters()
    return init


def _meta_built(rank, world):
    """Built on the meta device, materialized by ZeRO-3 with ``seeded_init``: each rank's
    part of the whole model that init gives in one process."""
    mesh = moe_mesh()
    with torch.device("meta"):
        model = expert_parallel_meta(mesh)
    torch.manual_seed(0)     # (the same generators on every rank, as a meta build asks)
    model = zero(3, group=mesh["dp"], groups={PATTERN: mesh["edp"]},
                 init=seeded_init(model))(model)
    whole = reference()
    whole.apply(seeded_init(whole))
    full, _ = zf.get_state_dict(model, optimizer("adamw", model.parameters()), full=True)
    return all(torch.equal(v, whole.state_dict()[k]) for k, v in full.items())


def test_meta_built_experts_materialize_with_an_init_seeded_per_expert():
    assert run_ranks(4, _meta_built) == [True] * 4
