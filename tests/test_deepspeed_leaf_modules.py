"""DeepSpeed's ZeRO-3 leaf modules (``deepspeed.utils.set_z3_leaf_modules`` and the config's
``zero_optimization.leaf_module``): how modules are marked, the units that makes, and a
mixture of experts trained through ``zerofn.deepspeed.initialize`` with its blocks marked."""
from __future__ import annotations

import warnings

import pytest
import torch

import zerofn as zf
import zerofn.deepspeed as deepspeed
from support.compare import TOL, max_errors
from support.experts import Experts, expert_choices
from support.ranks import run_ranks
from zerofn.deepspeed.utils import leaf_units
from zerofn.runtime.runtime import runtime_of

pytestmark = pytest.mark.deepspeed


class Layer(torch.nn.Module):
    """A transformer layer's shape: a dense part, then a mixture of experts."""

    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Linear(8, 8)
        self.moe = Experts()

    def forward(self, x, choice):
        return self.moe(x + torch.tanh(self.attn(x)), choice)


class MoENet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(3))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x, choices):
        x = self.inp(x)
        for layer, choice in zip(self.layers, choices.unbind(1)):
            x = layer(x, choice)
        return self.head(x).pow(2).mean()


class SubExperts(Experts):
    pass


def test_modules_are_marked_by_class_subclass_name_path_and_suffix():
    u = deepspeed.utils
    model = MoENet()
    model.layers[1].moe = SubExperts()
    moes = [layer.moe for layer in model.layers]
    assert u.set_z3_leaf_modules(model, [Experts]) == moes          # subclasses too
    assert u.get_z3_leaf_modules(model) == moes and u.z3_leaf_module(moes[0])
    assert u.unset_z3_leaf_modules(model, Experts) == moes
    assert u.get_z3_leaf_modules(model) == []
    assert u.set_z3_leaf_modules(model, ["SubExperts"]) == [moes[1]]
    assert u.set_z3_leaf_modules(model, [f"{Experts.__module__}.Experts"]) == moes
    u.unset_z3_leaf_modules(model, [Experts])
    assert u.set_z3_leaf_modules_by_name(model, ["layers.2.moe", "layers.9"],
                                         raise_if_not_found=False) == ([moes[2]], ["layers.9"])
    assert u.set_z3_leaf_modules_by_suffix(model, ["moe", "experts.9"],
                                           raise_if_not_found=False) == (moes, ["experts.9"])
    # a suffix is whole dotted components: "oe" is no suffix of "layers.0.moe"
    assert u.set_z3_leaf_modules_by_suffix(model, "oe", raise_if_not_found=False) == ([], ["oe"])
    with pytest.raises(ValueError, match="No module of"):
        u.set_z3_leaf_modules(model, ["Missing"])
    with pytest.raises(ValueError, match=r"named \['nope'\]"):
        u.set_z3_leaf_modules_by_name(model, ["nope"])
    with pytest.raises(TypeError, match="classes or class names"):
        u.set_z3_leaf_modules(model, [3])


def test_leaves_are_units_beside_the_default_ones_and_hook_nothing_below():
    """A leaf inside a default unit is a unit of its own, nested; default units inside a
    leaf, and leaves inside another, are not units."""
    u = deepspeed.utils
    model = MoENet()
    assert leaf_units(model) is None
    u.set_z3_leaf_modules(model, [Experts])
    assert leaf_units(model) == [m for layer in model.layers for m in (layer, layer.moe)]
    u.set_z3_leaf_modules_by_name(model, ["layers.0"])
    assert leaf_units(model) == [model.layers[0]] + [
        m for layer in model.layers[1:] for m in (layer, layer.moe)]


def test_the_configs_leaf_module_section_marks_and_makes_units():
    model = MoENet()
    config = {"train_batch_size": 4, "zero_optimization": {
        "stage": 3, "leaf_module": {"classes": "Experts", "names": ["layers.0.attn"],
                                    "name_suffixes": ["router", "gate"]}}}
    with pytest.warns(deepspeed.DeepSpeedConfigWarning, match=r"\['gate'\] match no module"):
        settings = zf.from_deepspeed_config(config, model=model, world_size=1)
    routers = [layer.moe.router for layer in model.layers]
    assert deepspeed.utils.get_z3_leaf_modules(model) == [model.layers[0].attn] + [
        m for layer in model.layers for m in (layer.moe, layer.moe.router)]
    assert settings.transforms["shard_optimizer"]["units"] == [
        model.layers[0], model.layers[0].attn, model.layers[0].moe,
        model.layers[1], model.layers[1].moe, model.layers[2], model.layers[2].moe]
    assert not any(r in settings.transforms["shard_optimizer"]["units"] for r in routers)
    with pytest.raises(ValueError, match="pass model= to from_deepspeed_config"):
        zf.from_deepspeed_config(config, world_size=1)
    with pytest.raises(ValueError, match=r"leaf_module has \['module'\]"):
        zf.from_deepspeed_config({"train_batch_size": 4, "zero_optimization": {
            "stage": 3, "leaf_module": {"module": "Experts"}}}, model=MoENet(), world_size=1)
    with pytest.warns(deepspeed.DeepSpeedConfigWarning, match="leaf_module: a ZeRO-3 setting"):
        settings = zf.from_deepspeed_config(dict(config, zero_optimization={
            "stage": 2, "leaf_module": {"classes": "Experts"}}), model=MoENet(), world_size=1)
    assert "units" not in settings.transforms["shard_optimizer"]


def leaf_engine_runs(rank, world):
    """Plain PyTorch on the global batch against the engine on this rank's share, the
    experts sitting out on one rank per layer each step (support.experts.expert_choices)."""
    torch.manual_seed(0)
    ref, model = MoENet(), MoENet()
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0,
              "zero_optimization": {"stage": 3, "leaf_module": {"classes": ["Experts"]}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, opt, _, _ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)
    units = [u.name for u in runtime_of(engine.module).units]
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x, c = torch.randn(2 * world, 8, generator=g), expert_choices(step, world)
        ref(x, c).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        engine.backward(engine(x.chunk(world)[rank], c.chunk(world)[rank]))
        engine.step()
    return units, max_errors(ref, ref_opt, engine.module, opt)


@pytest.mark.multirank
def test_a_mixture_with_its_blocks_marked_leaves_trains_through_initialize():
    for units, (p_err, s_err) in run_ranks(2, leaf_engine_runs):
        assert units == ["layers.0", "layers.0.moe", "layers.1", "layers.1.moe", "layers.2",
                         "layers.2.moe", "<root>"], units
        assert p_err < TOL and s_err < TOL, (p_err, s_err)
