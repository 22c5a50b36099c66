"""Hugging Face transformers models in a plain loop: every stage, fp32 and bf16, at world 2
(world 1 too under ZEROFN_SLOW=1: a rank alone runs the same code whatever the model, and
test_parity.py checks it at world 1 in every run); a model built in bf16 at world 1 and 2.

Three tiny configs with awkward sizes (support/hf_models.py): a Llama with grouped-query
attention (2 key/value heads for 6 query heads), tied embeddings, left padding and
gradient checkpointing; a Qwen3 mixture of experts (left padding); and a GPT-2 (Conv1D
weights stored transposed, learned positions, tied embeddings) with right padding. All are
built with ``AutoModelForCausalLM.from_config`` (no hub access).

fp32 is compared with plain single-process PyTorch on the same global batch, as
test_parity.py does. bf16 is compared bit for bit with FSDP2 under the same policy (bf16
parameters and all-gather, fp32 reduction, fp32 masters), and loosely with fp32.
"""
from __future__ import annotations


import pytest
import torch

import zerofn as zf
from support.compare import TOL, TOL_BF16_VS_FP32
from support.loops import zero
from support import SLOW, slow_variant
from support.ranks import run_ranks

transformers = pytest.importorskip("transformers")
from support.hf_models import (MODELS, PAD, adamw, build, global_batches,  # noqa: E402
                               max_err, reference, train)
from support.shared_runs import shared

pytestmark = pytest.mark.hf


def fsdp2_bf16(name: str, data, rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = build(name)
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model.transformer.h if name == "gpt2" else model.model.layers):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = adamw(model)
    train(model, opt, data, rank, world)
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def every_config(rank, world):
    """Every model x every stage x fp32/bf16, in one process per rank."""
    out = {}
    for name in MODELS:
        data = global_batches(name)
        fp32 = reference(name, data)
        fsdp2 = fsdp2_bf16(name, data, rank, world)
        for stage in (1, 2, 3):
            for bf16 in (False, True):
                model = build(name)
                opt = adamw(model)
                parts = [zero(stage)]
                if bf16:
                    parts.append(zf.mixed_precision(torch.bfloat16, reduce_dtype=torch.float32))
                model, opt = zf.compose(*parts)(model, opt)
                train(model, opt, data, rank, world)
                msd, _ = zf.get_state_dict(model, opt, full=True)
                out[name, stage, bf16] = (max_err(msd, fp32), max_err(msd, fsdp2) if bf16 else None)
    return out


def named_runs(rank, world, names):
    runs = {"every config": every_config, "bf16 model": bf16_checkpoint_runs}
    return {name: runs[name](rank, world) for name in names}


@shared
def runs_at(world: int) -> dict[str, list]:
    """The tests' runs at ``world`` from one launch (each rank imports transformers once):
    each one's results, a list over the ranks. At world 1 every config only under
    ZEROFN_SLOW=1, as its test runs."""
    names = ["bf16 model"] + ["every config"] * (world > 1 or SLOW)
    per_rank = run_ranks(world, named_runs, names, timeout=600)
    return {name: [r[name] for r in per_rank] for name in names}


@pytest.mark.multirank
@pytest.mark.parametrize("world", [slow_variant(1, covered_by=(
    "[2] and test_parity.py::test_parity_matrix[1]")), 2])
def test_hf_models_follow_plain_pytorch(world):
    for rank, results in enumerate(runs_at(world)["every config"]):
        for (name, stage, bf16), (vs_fp32, vs_fsdp2) in results.items():
            where = f"world {world} rank {rank} {name} stage {stage} {'bf16' if bf16 else 'fp32'}"
            if bf16:
                assert vs_fsdp2 == 0.0, (where, vs_fsdp2)
                assert vs_fp32 < TOL_BF16_VS_FP32, (where, vs_fp32)
            else:
                assert vs_fp32 < TOL, (where, vs_fp32)


def test_padding_and_grouped_query_attention_are_exercised():
    """The comparisons above mean something only if rows differ in length, padding sits
    where the masks say, and the Llama really shares key/value heads and checkpoints."""
    for name in ("llama", "gpt2"):
        ids, mask, labels = global_batches(name)[0]
        assert len(set(mask.sum(1).tolist())) > 1
        assert (ids[mask == 0] == PAD).all() and (labels[mask == 0] == -100).all()
    model = build("llama")
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.out_features * 3 == attn.q_proj.out_features   # 2 kv heads for 6
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    assert model.lm_head.weight is model.model.embed_tokens.weight
    gpt2 = build("gpt2")
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight


def bf16_checkpoint_runs(rank, world):
    """A Llama built in bf16 (as transformers 5 builds a bf16 hub checkpoint) under ZeRO-3
    and mixed precision, against FSDP2 on the same model upcast to fp32 under a bf16
    policy: the difference, the dtypes of the optimizer state, and its bytes a parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    data = global_batches("llama")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    theirs = build("llama").to(torch.bfloat16).float()
    mesh = init_device_mesh("cpu", (world,))
    for layer in theirs.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(theirs, mesh=mesh, mp_policy=policy)
    train(theirs, adamw(theirs), data, rank, world)
    fsdp2 = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
    out = {}
    for stage, offload in ((3, None), (2, None), (2, "cpu")):
        model = build("llama").to(torch.bfloat16)
        opt = adamw(model)
        parts = [zero(stage), zf.mixed_precision(torch.bfloat16, reduce_dtype=torch.float32)]
        parts += [zf.offload(offload)] if offload else []
        model, opt = zf.compose(*parts)(model, opt)
        n = sum(p.numel() for p in build("llama").parameters())
        train(model, opt, data, rank, world)
        msd, osd = zf.get_state_dict(model, opt, full=True)
        dtypes = {v.dtype for st in osd["state"].values() for k, v in st.items() if k != "step"}
        held = zf.model_state_bytes(model)
        optim = sum(where["optimizer"] for where in held.values())
        out[stage, offload] = (max_err(msd, fsdp2), dtypes, {v.dtype for v in msd.values()},
                               optim / n)
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2])
def test_a_bf16_model_under_mixed_precision_keeps_fp32_masters_and_trains_as_fsdp2(world):
    results = runs_at(world)["bf16 model"]
    for config in results[0]:     # the optimizer's bytes a parameter, summed over the ranks
        per_param = sum(r[config][3] for r in results)
        assert 12 <= per_param < 12.5, (config, per_param)    # masters + 2 moments, fp32
    for by_config in results:
        for config, (vs_fsdp2, state_dtypes, param_dtypes, _) in by_config.items():
            assert state_dtypes == {torch.float32} and param_dtypes == {torch.float32}, config
            # bit for bit on the device; zerofn's C++ Adam rounds its own way on the host
            assert vs_fsdp2 <= (0.0 if config[1] is None else 1e-6), (world, config, vs_fsdp2)
