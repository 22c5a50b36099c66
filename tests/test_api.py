"""The transforms' contract: composition, what the returned objects keep, and clear errors."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import zerofn as zf
from support.compare import max_errors, worst
from support.errors import error_of
from support.loops import build_parity, step_once, train_reference, train_sharded, zero
from support.models import batches, make_models, make_optimizer
from support.odd_models import expected_units
from support.offload import build_offloaded
from support.ranks import run_ranks
from zerofn.core.units import default_unit_modules


def world_2_runs(rank, world, root):
    """The runs of the two-rank tests below that return what they saw, in one launch:
    step_and_gather_order first, in processes no other run has stepped in."""
    order = {("order", stage): step_and_gather_order(rank, world, stage) for stage in (1, 2)}
    return {**order, "one at a time": one_at_a_time(rank, world),
            "full params": full_params_only_while_running(rank, world),
            "aligned": misaligned(rank, world, root),
            "sequential": sequential_vs_compose(rank, world, root),
            "graphs": forward_graphs_are_freed(rank, world),
            "raised": raised_forwards_free_their_models(rank, world),
            "stepped after raised": steps_after_a_raised_forward(rank, world),
            "self-calling root": self_calling_root_runs(rank, world)}


@pytest.fixture(scope="module")
def at_world_2(tmp_path_factory) -> dict:
    """world_2_runs' results, each a list over the two ranks."""
    per_rank = run_ranks(2, world_2_runs, str(tmp_path_factory.mktemp("api")), timeout=400)
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


def one_at_a_time(rank, world):
    """Applying transforms one by one (in any order) equals compose, and keeps the objects."""
    results = []
    for order in (("shard_optimizer", "shard_grads", "shard_params"),
                  ("shard_params", "shard_optimizer", "shard_grads")):
        ref, model = make_models()
        ref_opt, opt = make_optimizer("adamw", ref.parameters()), make_optimizer("adamw", model.parameters())
        original_model, original_opt = model, opt
        for name in order:
            model, opt = getattr(zf, name)()(model, opt)
        assert model is original_model and opt is original_opt
        assert type(opt) is torch.optim.AdamW and opt.defaults["weight_decay"] == 0.1
        data = batches(3, 1, world)
        train_reference(ref, ref_opt, data)
        train_sharded(model, opt, data, rank, world)
        results.append(max_errors(ref, ref_opt, model, opt))
    return results


@pytest.mark.multirank
def test_transforms_compose_one_at_a_time(at_world_2):
    for errs in at_world_2["one at a time"]:
        for p_err, s_err in errs:
            assert p_err < 1e-5 and s_err < 1e-5


def shard_grads_alone(rank, world):
    _, model = make_models()
    opt = make_optimizer("sgd", model.parameters())
    model, opt = zf.shard_grads()(model, opt)
    return model._zerofn.plan.stage


@pytest.mark.multirank
def test_shard_grads_implies_shard_optimizer():
    assert run_ranks(1, shard_grads_alone) == [2]


def applied_twice(rank, world):
    _, model = make_models()
    opt = make_optimizer("sgd", model.parameters())
    model, opt = zf.shard_params()(model, opt)
    with pytest.raises(ValueError, match="applied twice"):
        zf.shard_params()(model, opt)
    return True


@pytest.mark.multirank
def test_transform_applied_twice_is_an_error():
    run_ranks(1, applied_twice)


def test_no_process_group_is_a_clear_error():
    _, model = make_models()
    with pytest.raises(RuntimeError, match="init_process_group"):
        zf.shard_optimizer()(model, make_optimizer("sgd", model.parameters()))


def test_bad_options_fail_at_once():
    with pytest.raises(TypeError, match="prefetch"):
        zf.shard_optimizer(prefetch=2)
    with pytest.raises(TypeError, match="compose"):
        zf.compose(zf.shard_params(), "shard_grads")
    with pytest.raises(TypeError, match=r"^zerofn.compose\(\) needs at least one transform"):
        zf.compose()
    with pytest.raises(TypeError, match=r"^zerofn.offload\(\) got unknown option\(s\) "
                                        r"\['param'\] \(did you mean 'params'\?\); it accepts"):
        zf.offload("cpu", param=True)
    with pytest.raises(TypeError, match=r"\['prefech'\] \(did you mean 'prefetch'\?\)"):
        zf.shard_params(prefech=2)
    with pytest.raises(TypeError, match=r"\['logdir_'\] \(did you mean 'logdir'\?\)"):
        zf.tensorboard("runs", logdir_="x")


def disagreeing(rank, world, what):
    """Each rank gets a different model or plan; every rank must raise, none may hang."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8 + (rank if what == "model" else 0)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t = zf.shard_params(prefetch=1 + rank) if what == "plan" else zf.shard_params()
    if what == "optimizer" and rank == 1:
        opt = torch.optim.SGD(list(model.parameters()) + [nn.Parameter(torch.ones(2))], lr=0.1)
    return error_of(t, model, opt)


@pytest.mark.multirank
@pytest.mark.parametrize("what,message", [("model", "disagree"), ("plan", "prefetch"),
                                          ("optimizer", "not a parameter of the model")])
def test_ranks_that_disagree_all_raise(what, message):
    for msg in run_ranks(2, disagreeing, what, timeout=60):
        assert msg is not None and message in msg


def full_params_only_while_running(rank, world):
    """ZeRO-3: inside a unit's forward its params are full tensors; outside, Shard(0) DTensors."""
    from torch.distributed.tensor import DTensor
    model, opt = build_parity(3)
    seen = []
    block = model.blocks[0]
    block.fc.register_forward_hook(
        lambda m, a, o: seen.append((type(m.weight) is nn.Parameter, tuple(m.weight.shape),
                                     isinstance(model.blocks[1].fc.weight, DTensor))))
    step_once(model, opt, rank, world)
    assert seen == [(True, (130, 48), True)]
    assert isinstance(block.fc.weight, DTensor)
    assert zf.model_state_bytes(model)["cpu"]["params"] < 4 * sum(
        p.numel() for p in model.parameters()) / world + 4096
    return True


@pytest.mark.multirank
def test_zero3_full_params_exist_only_while_unit_runs(at_world_2):
    assert at_world_2["full params"] == [True, True]   # (its checks raise in the ranks)


def misaligned(rank, world, path):
    """ZeRO-3 in fp32, bf16, and bf16 with parameter offload to the host and to NVMe: the
    parameters each module's forward and backward see (gathered), and the shards between
    steps, whose address is not a multiple of 16 bytes ([Note: aligned slots]; CUDA's
    grouped GEMM refuses those). The parity model's odd sizes (an FFN of 130, a 3-element
    gain) would misalign every later parameter of a tightly packed unit."""
    out = []
    for precision, offload in ((None, None), (torch.bfloat16, None),
                               (torch.bfloat16, {"params": True}),
                               (torch.bfloat16, {"nvme": True, "params": True, "path": path})):
        model, opt = build_offloaded(3, "adamw", offload, precision)
        bad, seen = [], set()

        def check(module, *_):
            for name, p in module.named_parameters(recurse=False):
                seen.add((module, name))
                if p.numel() and p.data_ptr() % 16:
                    bad.append((type(module).__name__, name, p.data_ptr() % 16))

        for m in model.modules():
            m.register_forward_pre_hook(check)
            m.register_full_backward_pre_hook(check)
        for step in batches(2, 1, world):
            train_sharded(model, opt, [step], rank, world)
            bad += [("shard", n, p.to_local().data_ptr() % 16) for n, p in model.named_parameters()
                    if p.to_local().numel() and p.to_local().data_ptr() % 16]
        out.append((precision, offload and sorted(offload), bad, len(seen)))
    return out


@pytest.mark.multirank
def test_zero3_parameters_and_shards_are_16_byte_aligned(at_world_2):
    for rank_result in at_world_2["aligned"]:
        for precision, offload, bad, seen in rank_result:
            assert seen >= 10 and bad == [], (precision, offload, bad)


def sequential_vs_compose(rank, world, root):
    """Precision and NVMe offload applied one by one (each rank with its own swap directory,
    as with node-local drives) train exactly like the composed transform."""
    import os
    path = os.path.join(root, f"rank{rank}")
    os.makedirs(path, exist_ok=True)
    ts = lambda: [zf.shard_params(), zf.offload("nvme", path=path),  # noqa: E731
                  zf.mixed_precision(torch.bfloat16)]
    results = []
    for one_by_one in (False, True):
        _, model = make_models()
        opt = make_optimizer("adamw", model.parameters())
        if one_by_one:
            for t in ts():
                model, opt = t(model, opt)
        else:
            model, opt = zf.compose(*ts())(model, opt)
        train_sharded(model, opt, batches(3, 1, world), rank, world)
        results.append(zf.get_state_dict(model, opt, full=True)[0])
    return max(worst(results[0][k] - results[1][k]) for k in results[0])


@pytest.mark.multirank
def test_precision_and_offload_compose_one_at_a_time(at_world_2):
    assert at_world_2["sequential"] == [0.0, 0.0]


def step_and_gather_order(rank, world, stage):
    """The order of the device home's optimizer steps and the parameter all-gathers inside
    one ``opt.step()``, and where the user's own step hook runs."""
    import zerofn.runtime.homes.device as device_home
    from zerofn.runtime.comm import Comm

    events = []
    gather, inner = Comm.all_gather, device_home.step_without_hooks
    Comm.all_gather = lambda self, *a, **k: events.append("gather") or gather(self, *a, **k)
    device_home.step_without_hooks = lambda opt: events.append("unit step") or inner(opt)
    try:
        model, opt = build_parity(stage)
        opt.register_step_pre_hook(lambda *_: events.append("step"))
        (x, y), = batches(1, 1, world)[0]
        model(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        events.clear()
        opt.step()
    finally:    # (the launch goes on)
        Comm.all_gather, device_home.step_without_hooks = gather, inner
    return events


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_gather_each_unit_while_the_next_steps(at_world_2, stage):
    """ZeRO-1/2 step the optimizer one unit at a time and launch that unit's all-gather
    right after, so it overlaps the next unit's step (parity tests show the result is
    the same step)."""
    events = at_world_2["order", stage][0]
    # one inner step and one gather per unit (several units), then the user's own step
    # hook, once: it runs after zerofn's, and the step finds nothing left to do
    assert len(events) > 5 and events[-1] == "step"
    assert events[:-1] == ["unit step", "gather"] * ((len(events) - 1) // 2), events


def dropped_models_are_freed(rank, world, path):
    """Weak references to each trained model and its optimizer, after the last strong
    ones are gone and the collector has run."""
    alive = []
    for stage, extra in ((1, []), (2, [zf.mixed_precision(torch.bfloat16)]),
                         (3, [zf.offload("cpu", params=True)]),
                         (3, [zf.offload("nvme", path=path)])):
        model, opt = build_parity(stage, "adamw", *extra)
        train_sharded(model, opt, batches(2, 1, world), rank, world)
        refs = weakref.ref(model), weakref.ref(opt)
        del model, opt
        gc.collect()
        alive.append([r() is not None for r in refs])
    return alive


@pytest.mark.multirank
def test_a_dropped_model_frees_its_memory(tmp_path):
    """Gradient hooks live in C++, out of the collector's sight: one holding the runtime
    kept every model, its device memory and its pinned arenas, for the process's life."""
    for alive in run_ranks(2, dropped_models_are_freed, str(tmp_path)):
        assert alive == [[False, False]] * 4, alive


def forward_graphs_are_freed(rank, world):
    """Weak references to the activations a block's forward saves (tanh saves its output),
    after forwards with gradients enabled whose loss is dropped, and after a step."""
    model, opt = build_parity(3)
    saved = []
    model.blocks[0].register_forward_hook(lambda m, a, out: saved.append(weakref.ref(out)))
    x, y = batches(1, 1, world)[0][0]
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    for _ in range(2):
        model(x, y)                  # an evaluation without torch.no_grad()
    model(x, y).backward()           # and the training step that follows must not hang
    opt.step()
    gc.collect()
    return [r() is not None for r in saved]


@pytest.mark.multirank
def test_a_forward_backward_never_reaches_frees_its_graph_under_zero3(at_world_2):
    """A saved-tensor hook that kept the tensors as given made each such forward's graph a
    cycle through C++: never freed, and, counted as a forward whose backward was still to
    come, it kept the units from completing when their backward was done."""
    for alive in at_world_2["graphs"]:
        assert alive == [False] * 3, alive


def raised_forwards_free_their_models(rank, world):
    """Weak references to each trained model whose next forward raised (a user's pre-hook,
    as an OOM caught to retry would), after its last strong one is gone, at each stage."""
    alive = []
    for stage in (1, 2, 3):
        model, opt = build_parity(stage)
        data = batches(2, 1, world)
        train_sharded(model, opt, data[:1], rank, world)
        model.blocks[0].register_forward_pre_hook(_raise_value_error)
        x, y = data[1][0]
        with pytest.raises(ValueError, match="injected"):
            model(x.chunk(world)[rank], y.chunk(world)[rank])
        ref = weakref.ref(model)
        del model, opt
        gc.collect()
        alive.append(ref() is not None)
    return alive


def _raise_value_error(module, args):
    raise ValueError("injected")


@pytest.mark.multirank
def test_a_model_whose_forward_raised_is_freed(at_world_2):
    """ZeRO-3: the gather a forward prefetched for a unit it never reached stays pending,
    and its work keeps, in C++, the saved-tensor hooks it was started under. Hooks holding
    the gatherer made that a cycle the collector cannot see: the model and all its memory
    were kept after the error (an OOM caught to retry, say)."""
    for alive in at_world_2["raised"]:
        assert alive == [False] * 3, alive


def steps_after_a_raised_forward(rank, world):
    """Per stage: the losses of two forwards without gradients after a step that followed
    a forward that raised (a micro-batch's OOM caught and skipped under accumulation)."""
    losses = {}
    for stage in (1, 2, 3):
        model, opt = build_parity(stage)
        (x, y), = batches(1, 1, world)[0]
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        model(x, y).backward()
        hook = model.blocks[0].register_forward_pre_hook(_raise_value_error)
        with pytest.raises(ValueError, match="injected"):
            model(x, y)
        hook.remove()
        opt.step()
        with torch.no_grad():
            losses[stage] = [model(x, y).item() for _ in range(2)]
    return losses


@pytest.mark.multirank
def test_a_step_after_a_raised_forward_is_what_the_next_forward_computes_with(at_world_2):
    """The gathers a ZeRO-3 forward prefetched for units it never reached, before it raised,
    held the shards from before the step: the next forward computed with the old weights
    (at two ranks a loss of 3.5598, then 3.5363 once gathered again)."""
    for by_stage in at_world_2["stepped after raised"]:
        for stage, (first, second) in by_stage.items():
            assert first == second, (stage, first, second)


class _CallsItself(nn.Module):
    """A root whose forward calls the module itself, as Lightning's ``training_step``
    calls the LightningModule it is a method of."""
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, y, outer=True):
        return self(x, y, outer=False) if outer else self.inner(x, y)


def self_calling_root_runs(rank, world):
    """ZeRO-3, 2 steps of the parity model under a root that calls itself and of the same
    model alone: the losses, and the saved-tensor hooks still pushed after each step."""
    out = []
    for wrap in (_CallsItself, lambda m: m):
        _, model = make_models()
        model = wrap(model)
        opt = make_optimizer("adamw", model.parameters())
        model, opt = zero(3)(model, opt)
        losses, left = [], []
        for (x, y), in batches(2, 1, world):
            loss = model(x.chunk(world)[rank], y.chunk(world)[rank])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            left.append(torch._C._autograd._top_saved_tensors_default_hooks(False))
        out.append((losses, left))
    return out


@pytest.mark.multirank
def test_a_root_that_calls_itself_pushes_its_saved_tensor_hooks_once(at_world_2):
    """Each call of the root pushed ZeRO-3's saved-tensor hooks and only the outer one's
    end popped them: every step of a Lightning job left one pushed, and once its model
    was gone the next job's forward packed through a dead gatherer."""
    for (nested, left), (alone, _) in at_world_2["self-calling root"]:
        assert left == [None, None], left
        assert nested == alone, (nested, alone)


class _ExpertBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))

    def forward(self, x):
        return self.lin(x)


class _Stages(nn.Module):
    """Stages of blocks, a list of lists, each block holding a list of experts."""

    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList(nn.ModuleList(_ExpertBlock() for _ in range(2))
                                    for _ in range(2))


def test_default_units_are_the_outermost_lists_modules_even_in_a_list_of_lists():
    """A list that does not run (a list of lists) is looked through; a block's own lists
    (experts) are not units."""
    model = _Stages()
    names = {m: n for n, m in model.named_modules()}
    units = [names[m] for m in default_unit_modules(model)]
    assert units == ["stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1"]
    assert {names[m] for m in set(expected_units(model, None).values())} == set(units)
