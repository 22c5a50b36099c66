"""zf.clip_grad_norm_ of orders 1 and inf, as torch's on the same global batch: without
offload, and under offload, where the gradient shards are on the host and the rank's part
of the norm is filled in on the device rather than copied up tensor by tensor."""
from __future__ import annotations

import math

import pytest
import torch

import zerofn as zf
from support.compare import TOL, max_errors
from support.loops import zero
from support.models import batches, make_models, make_optimizer
from support.ranks import run_ranks

pytestmark = pytest.mark.multirank

CLIP = 0.05
CONFIGS = [(2, "sgd", None), (2, "sgd", {}), (3, "adamw", {"params": True})]


def clip_runs(rank, world, norm_type):
    out = []
    data = batches(3, 1, world)
    for stage, kind, offload in CONFIGS:
        ref, model = make_models()
        ref_opt = make_optimizer(kind, ref.parameters())
        opt = make_optimizer(kind, model.parameters())
        extra = [] if offload is None else [zf.offload("cpu", **offload)]
        model, opt = zf.compose(zero(stage), *extra)(model, opt)
        norms = []
        for (x, y), in data:
            ref(x, y).backward()
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP, norm_type)
            ref_opt.step()
            ref_opt.zero_grad()
            model(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
            got = zf.clip_grad_norm_(model, CLIP, norm_type)
            opt.step()
            opt.zero_grad()
            norms.append((float(got), float(want)))
        out.append((norms, max_errors(ref, ref_opt, model, opt)))
    return out


@pytest.mark.parametrize("norm_type", [1.0, math.inf])
def test_norms_of_other_orders_clip_as_torch_does(norm_type):
    for rank_out in run_ranks(2, clip_runs, norm_type):
        for config, (norms, (p_err, s_err)) in zip(CONFIGS, rank_out):
            assert all(w > CLIP for _, w in norms), (config, norms)   # it did clip
            assert all(abs(g - w) <= 1e-5 * w for g, w in norms), (config, norms)
            assert p_err < TOL and s_err < TOL, (config, p_err, s_err)
