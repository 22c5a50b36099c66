"""torch.compile over a zerofn model: the whole model compiled after the transforms, or
each block before them (FSDP2's way), trains exactly as the same model uncompiled; so do
compiled transformers models (Llama, GPT-2).

The backend is ``aot_eager``: dynamo captures the graphs and AOTAutograd builds their
backward, the two parts that meet zerofn's hooks (module hooks, tensor hooks, the saved
tensors hooks of ZeRO-3), without inductor's kernels, whose fusions round differently and
whose C++ compile takes a minute here. zerofn's hooks run outside the graphs
(runtime/params.py's [Note: hooks under torch.compile]).
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

import zerofn as zf
from support.compare import TOL, worst
from support.loops import train_sharded, zero
from support.models import batches, make_models, make_optimizer
from support.ranks import run_ranks

pytestmark = pytest.mark.multirank

# (stage, accumulation, what is compiled, extras: transforms, or activation checkpointing)
CONFIGS = [(1, 1, "model", ()), (2, 2, "model", ()), (3, 2, "model", ("checkpoint",)),
           (3, 1, "blocks", ()), (3, 1, "model", ("bf16", "offload", "tensorboard"))]
EXTRA = {"bf16": lambda logs: zf.mixed_precision(torch.bfloat16),
         "offload": lambda logs: zf.offload("cpu", params=True),
         "tensorboard": lambda logs: zf.tensorboard(logs, every=1)}


def run(stage: int, accum: int, compiled: str | None, extra, rank: int, world: int, logs):
    """The model's full state after training, and the graphs dynamo compiled for it."""
    torch._dynamo.reset()
    _, model = make_models(checkpoint="checkpoint" in extra)
    if compiled == "blocks":
        for block in model.blocks:
            block.compile(backend="aot_eager")
    opt = make_optimizer("adamw", model.parameters())
    model, opt = zf.compose(zero(stage), *(EXTRA[e](logs) for e in extra if e in EXTRA))(
        model, opt)
    if compiled == "model":
        model.compile(backend="aot_eager")
    train_sharded(model, opt, batches(3, accum, world), rank, world)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return zf.get_state_dict(model, opt, full=True), graphs


def compiled_vs_eager(rank, world, logs):
    out = []
    for stage, accum, compiled, extra in CONFIGS:
        (msd, osd), graphs = run(stage, accum, compiled, extra, rank, world, logs + "/compiled")
        (ref_msd, ref_osd), _ = run(stage, accum, None, extra, rank, world, logs + "/eager")
        p_err = max(worst(msd[k] - v) for k, v in ref_msd.items())
        s_err = max(worst(st[k] - ref_osd["state"][name][k])
                    for name, st in osd["state"].items() for k in ("exp_avg", "exp_avg_sq"))
        out.append((p_err, s_err, graphs))
    return out


def test_compiled_models_train_as_eager_ones(tmp_path):
    for rank, results in enumerate(run_ranks(2, compiled_vs_eager, str(tmp_path), timeout=600)):
        for config, (p_err, s_err, graphs) in zip(CONFIGS, results):
            assert graphs > 0, (rank, config, "nothing was compiled")
            assert p_err <= TOL and s_err <= TOL, (rank, config, p_err, s_err)


def hugging_face(rank, world, name: str):
    """A transformers model (Llama with activation checkpointing, or GPT-2) under ZeRO-3 +
    bf16, compiled and not: full weights after three steps, and the graphs compiled."""
    from support.hf_models import adamw, build, global_batches, train
    out = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = build(name)
        opt = adamw(model)
        model, opt = zf.compose(zf.shard_optimizer(), zf.shard_grads(), zf.shard_params(),
                                zf.mixed_precision(torch.bfloat16))(model, opt)
        if compiled:
            model.compile(backend="aot_eager")
        train(model, opt, global_batches(name)[:3], rank, world)
        out.append((zf.get_state_dict(model, opt, full=True)[0],
                    torch._dynamo.utils.counters["stats"]["unique_graphs"]))
    (eager, _), (compiled, graphs) = out
    return max(worst(compiled[k] - v) for k, v in eager.items()), graphs


@pytest.mark.hf
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_compiled_hugging_face_models_train_as_eager_ones(name):
    pytest.importorskip("transformers")
    for err, graphs in run_ranks(2, hugging_face, name, timeout=300):
        assert graphs > 0 and err <= TOL, (name, err, graphs)
