"""One home for configuration (zerofn/config.py): every front door turns its stage into
transforms through ``Config``, the plan's rules are stated once (``Plan.problems``), and
the homes' names once (``core.plan.HOMES``)."""
import ast
import pathlib

import pytest
import torch

import zerofn as zf
from zerofn.config import Config
from zerofn.core.plan import Plan
from zerofn.deepspeed.config import read_config
from zerofn.integrations.lightning.options import FLAGS, ZeroOptions
from zerofn.planner.candidates import Candidate

PACKAGE = pathlib.Path(zf.__file__).parent


def described(transforms) -> list[str]:
    plan = Plan()
    for t in transforms:
        plan = t.edit(plan)
    return plan.describe()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_config_makes_the_transforms_a_user_composes(stage):
    by_hand = [zf.shard_optimizer(bucket_size=1000), zf.shard_grads(), zf.shard_params(prefetch=2)]
    by_hand = by_hand[:stage] + [zf.mixed_precision(torch.bfloat16),
                                 zf.offload("cpu", ratio=0.5)]
    cfg = Config(stage, sharding={"bucket_size": 1000},
                 params={"prefetch": 2} if stage == 3 else {},
                 precision={"param_dtype": torch.bfloat16},
                 offload={"device": "cpu", "ratio": 0.5})
    assert described(cfg.transforms()) == described(by_hand)
    assert cfg.plan().stage == stage


def test_zero3_options_at_another_stage_are_refused():
    with pytest.raises(TypeError, match=r"only ZeRO-3 \(stage 3\) takes them"):
        Config(2, params={"prefetch": 2}).transforms()


@pytest.mark.parametrize("cfg, expected", [
    (Config(2, offload={"device": "cpu", "params": True}), "only ZeRO-3 has"),
    (Config(0, offload={"device": "cpu"}), "offload() shards nothing by itself"),
    (Config(1, offload={"device": "cpu", "master_dtype": torch.bfloat16}),
     "the compute dtype must be bf16"),
    (Config(1, sharding={"on_nonfinite": "raise"}, precision={"param_dtype": torch.float16}),
     "on_nonfinite='raise': under loss scaling"),
    (Config(1, offload={"device": "cpu", "overlap_step": True},
            sharding={"on_nonfinite": "skip"}), "the step cannot be skipped"),
])
def test_the_plan_rules_are_found_without_a_model(cfg, expected):
    assert any(expected in p for p in cfg.problems()), cfg.problems()


def test_a_good_config_has_no_problems():
    assert Config(3, precision={"param_dtype": torch.bfloat16},
                  offload={"device": "cpu", "params": True, "master_dtype": torch.bfloat16,
                           "state_dtype": torch.int8}).problems() == []


def test_the_front_doors_agree_on_a_plan():
    """The planner's candidate, the Lightning strategy's options and a DeepSpeed config for
    the same run make the same plan."""
    want = described(Config(3, precision={"param_dtype": torch.bfloat16},
                            offload={"device": "cpu", "params": True}).transforms())
    candidate = Candidate(3, "bf16", "cpu", params=True).transforms()
    lightning = ZeroOptions(stage=3, offload="cpu", offload_params=True).transform(
        FLAGS["bf16-mixed"], None, None, fitting=True)
    deepspeed = read_config({"train_batch_size": 2, "bf16": {"enabled": True},
                             "zero_optimization": {"stage": 3,
                                                   "offload_optimizer": {"device": "cpu"},
                                                   "offload_param": {"device": "cpu"}}},
                            world_size=1).transform
    for got in (candidate, [lightning], [deepspeed]):
        assert [line for line in described(got) if "reduce_dtype" not in line] == \
            [line for line in want if "reduce_dtype" not in line]


def _calls(name: str) -> list[str]:
    """Modules of the package that call ``name`` (a function or method)."""
    out = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if called == name:
                    out.append(str(path.relative_to(PACKAGE)))
                    break
    return sorted(out)


def test_one_place_turns_a_stage_into_transforms():
    assert _calls("shard_grads") == ["config.py"]
    assert _calls("shard_params") == ["config.py"]


def test_the_homes_are_named_once():
    literal = ("device", "host", "nvme")
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple) and all(isinstance(e, ast.Constant) for e in node.elts) \
                    and tuple(e.value for e in node.elts) == literal:
                found.append(str(path.relative_to(PACKAGE)))
    assert found == ["core/plan.py"]
