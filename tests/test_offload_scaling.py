"""Offload with Adam under loss scaling and clipping: gradients cross to the host in the
reduce dtype (fp16 stays fp16, half the bytes of fp32) and are never rewritten there; the
unscale and clip factors reach the C++ Adam as one multiplier (runtime/step_grads.py, [Note:
deferred scaling]). Training equals the same run without offload, and an overflow on one
rank still skips the step on all."""
from __future__ import annotations

import pytest
import torch

import zerofn as zf
from support.compare import state_errors
from support.loops import build_parity, train_sharded
from support.models import batches
from support.ranks import run_ranks
from zerofn.runtime.runtime import runtime_of

pytestmark = pytest.mark.multirank

CLIP = 0.05


def build(stage, offload, dtype=torch.float16, **precision):
    """The parity model under ZeRO-``stage``, ``dtype`` mixed precision and (``offload``)
    CPU offload."""
    extra = [zf.offload("cpu")] if offload else []
    return build_parity(stage, "adamw", zf.mixed_precision(dtype, **precision), *extra)


def scaled_runs(rank, world):
    """Per stage: fp32 under a static loss scale of 1024, offload against the same run
    without it (their only difference is CPU Adam vs torch's AdamW, ~1e-7); and fp16
    under dynamic scaling with an inf on rank 1 at step 1."""
    out = {}
    for stage in (1, 2, 3):
        data = batches(4, 2, world)
        runs = {}
        for offload in (False, True):
            model, opt = build(stage, offload, dtype=torch.float32, loss_scale=1024.0)
            norms = train_sharded(model, opt, data, rank, world, CLIP, scale=True)
            runs[offload] = ([float(n) for n in norms], zf.get_state_dict(model, opt, full=True))
        fp32 = (runs[False][0], runs[True][0], state_errors(runs[False][1], runs[True][1]))
        fp16 = {}
        for offload in (False, True):
            model, opt = build(stage, offload, initial_scale_power=10, hysteresis=1)
            norms = train_sharded(model, opt, data, rank, world, CLIP, scale=True,
                                  inf_on=(1, 1))
            scale = opt.state_dict()["zerofn_loss_scaler"]["scale"]
            # (what comes down through the host ring: each unit's gradients' dtype)
            fp16[offload] = ([float(n) for n in norms], scale,
                             {str(d) for d in (runtime_of(model).homes.ring.grad_dtype.values()
                                               if offload else ())})
        out[stage] = (fp32, fp16)
    return out


def test_offload_applies_unscale_and_clip_in_the_kernel_and_keeps_fp16_on_the_wire():
    for by_stage in run_ranks(2, scaled_runs):
        for stage, ((plain, off, (p_err, s_err)), fp16) in by_stage.items():
            assert all(n > CLIP for n in plain), plain          # clipping clips
            assert all(abs(a - b) <= 1e-6 * a for a, b in zip(plain, off)), (stage, plain, off)
            assert p_err < 1e-6 and s_err < 1e-6, (stage, p_err, s_err)
            (n_plain, s_plain, _), (n_off, s_off, wire) = fp16[False], fp16[True]
            assert wire == {"torch.float16"}, (stage, wire)
            # The inf step is skipped on both ranks (its norm is nan) and halves the scale.
            assert s_plain == s_off == 2.0 ** 9, (stage, s_plain, s_off)
            assert n_plain[1] != n_plain[1] and n_off[1] != n_off[1], (n_plain, n_off)
            # Before the first update the two runs see the same gradients. (Later their fp16
            # params may differ by an ulp: CPU Adam's masters and torch's differ by one fp32
            # ulp, which can round to fp16 either way.)
            assert abs(n_plain[0] - n_off[0]) <= 1e-5 * n_plain[0], (stage, n_plain, n_off)
            assert all(n == n for n in n_off[2:]), n_off
