"""Checkpoints move between zerofn and FSDP2 (``fully_shard``) both ways, through nothing
but torch's own ``get_state_dict`` / ``dcp.save`` / ``dcp.load`` / ``set_state_dict`` on
the FSDP2 side, and training continues as it would have without the move."""
from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

import pytest

import zerofn as zf
from support.compare import TOL, assert_same_state, max_error
from support.fsdp2 import fsdp2_full, fsdp2_parity
from support.loops import build_parity, train_sharded
from support.models import batches
from support.ranks import run_ranks
from zerofn.checkpoint import load_checkpoint, save_checkpoint
from zerofn.io.checkpoint import checksums

pytestmark = pytest.mark.multirank

STEPS = 3


# zerofn's side of a checkpoint FSDP2 reads: plain ZeRO-3, a share of the optimizer state
# on the device and the rest offloaded, Adam's moments stored in 8-bit codes (FSDP2 reads
# them decoded, as fp32) and in bf16 (saved in bf16; DCP casts them to FSDP2's fp32).
SAVERS = {"zero3": lambda: (), "ratio": lambda: (zf.offload("cpu", ratio=0.3),),
          "int8": lambda: (zf.offload("cpu", state_dtype=torch.int8),),
          "bf16": lambda: (zf.offload("cpu", state_dtype=torch.bfloat16),)}


def zerofn_to_fsdp2(rank, world, root, saver="zero3"):
    checksums.FILE_BYTES = 1024     # each rank's data in several files, as a large save's
    model, opt = build_parity(3, "adamw", *SAVERS[saver]())
    train_sharded(model, opt, batches(STEPS, 1, world), rank, world)
    ckpt = save_checkpoint(root, model, opt, step=STEPS)
    assert rank or all(os.path.exists(f"{ckpt}/__{r}_1.distcp") for r in range(world))
    saved = zf.get_state_dict(model, opt, full=True)
    later = batches(STEPS, 1, world, seed=2)
    train_sharded(model, opt, later, rank, world)

    fmodel, fopt = fsdp2_parity(init_device_mesh("cpu", (world,)), seed=7)
    msd, osd = get_state_dict(fmodel, fopt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(fmodel, fopt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert_same_state(saved, fsdp2_full(fmodel, fopt))
    train_sharded(fmodel, fopt, later, rank, world)
    if saver in ("int8", "bf16"):     # (zerofn went on rounding its moments; FSDP2 keeps fp32)
        return 0.0
    return max_error(zf.get_state_dict(model, opt, full=True), fsdp2_full(fmodel, fopt))


def fsdp2_to_zerofn(rank, world, path):
    fmodel, fopt = fsdp2_parity(init_device_mesh("cpu", (world,)))
    train_sharded(fmodel, fopt, batches(STEPS, 1, world), rank, world)
    msd, osd = get_state_dict(fmodel, fopt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    saved = fsdp2_full(fmodel, fopt)
    later = batches(STEPS, 1, world, seed=2)
    train_sharded(fmodel, fopt, later, rank, world)
    expected = fsdp2_full(fmodel, fopt)
    errors = {}
    for stage in (1, 2, 3):
        model, opt = build_parity(stage, seed=7)
        assert load_checkpoint(path, model, opt) == {}     # FSDP2 saved no step
        assert_same_state(saved, zf.get_state_dict(model, opt, full=True))
        train_sharded(model, opt, later, rank, world)
        errors[stage] = max_error(expected, zf.get_state_dict(model, opt, full=True))
    return errors


def both_ways(rank, world, tmp):
    return (zerofn_to_fsdp2(rank, world, os.path.join(tmp, "zerofn")),
            fsdp2_to_zerofn(rank, world, os.path.join(tmp, "fsdp2")))


@pytest.mark.parametrize("saver", ["ratio", "int8", "bf16"])
def test_fsdp2_reads_checkpoints_of_a_split_or_8_bit_optimizer_state(saver, tmp_path):
    for err in run_ranks(2, zerofn_to_fsdp2, str(tmp_path), saver):
        assert err < TOL, f"FSDP2 continued a zerofn checkpoint {err} away"


def test_checkpoints_move_between_zerofn_and_fsdp2(tmp_path):
    for to_fsdp2, to_zerofn in run_ranks(2, both_ways, str(tmp_path)):
        assert to_fsdp2 < TOL, f"FSDP2 continued a zerofn checkpoint {to_fsdp2} away"
        for stage, err in to_zerofn.items():
            assert err < TOL, f"ZeRO-{stage} continued an FSDP2 checkpoint {err} away"
