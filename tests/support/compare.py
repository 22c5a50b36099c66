"""How far one training's state is from another's, and the tolerances the tests hold it to."""
from __future__ import annotations

import torch

import zerofn as zf

# fp32 parity with plain PyTorch on the same global batch.
TOL = 1e-5
# bf16 compute against an fp32 run bounds gross errors only: bf16 keeps 8 bits of mantissa,
# and AdamW moves an element by about lr per step whatever its gradient's size, so where a
# gradient is near zero bf16 rounding can flip the step, up to 2 * lr * steps apart (4
# steps at lr 1e-3: 8e-3). Measured: 3.5e-3 on the Hugging Face models over 4 steps, 2.6e-3
# on the parity model over 50. The check that matters is against FSDP2 under the same
# policy (bf16 params and all-gather, fp32 reduction, fp32 masters): bit for bit.
TOL_BF16_VS_FP32 = 1e-2


def worst(t: torch.Tensor) -> float:
    """The largest magnitude in ``t`` (a difference), inf where it holds a NaN: Python's
    ``max()`` over per-tensor figures would pass a NaN by, unless it came first."""
    return t.abs().nan_to_num(nan=float("inf")).max().item()


def max_errors(ref, ref_opt, model, opt) -> tuple[float, float]:
    """Largest absolute differences of full params and of optimizer state, gathered onto
    the reference's device (under offload they lie on the host)."""
    device = next(ref.parameters()).device
    msd, osd = zf.get_state_dict(model, opt, full=True, device=device)
    p_err = max(worst(msd[k] - v) for k, v in ref.state_dict().items())
    names = {p: n for n, p in ref.named_parameters()}
    s_err = 0.0
    for p, state in ref_opt.state.items():
        for k, v in state.items():
            if torch.is_tensor(v) and v.dim() > 0:
                s_err = max(s_err, worst(osd["state"][names[p]][k] - v))
            else:
                assert float(osd["state"][names[p]][k]) == float(v), (names[p], k)
    assert len(osd["state"]) == len(ref_opt.state)
    return p_err, s_err


def state_errors(a, b) -> tuple[float, float]:
    """Largest differences of params and of optimizer state (its tensors, not the step
    counters) between two full (model, optimizer) state dicts, compared in fp32."""
    p_err = max(worst(a[0][k].float() - b[0][k].float()) for k in a[0])
    s_err = max(worst(v.float() - b[1]["state"][f][k].float())
                for f, st in a[1]["state"].items() for k, v in st.items()
                if torch.is_tensor(v) and v.dim())
    return p_err, s_err


def max_error(a, b) -> float:
    """Largest difference between two full (model, optimizer) states of the same layout,
    step counters included."""
    (ma, oa), (mb, ob) = a, b
    assert ma.keys() == mb.keys() and oa["state"].keys() == ob["state"].keys()
    err = max(worst(ma[k] - mb[k]) for k in ma)
    for fqn, st in oa["state"].items():
        for k, v in st.items():
            err = max(err, worst(torch.as_tensor(v) - torch.as_tensor(ob["state"][fqn][k])))
    return err


def assert_same_state(a, b) -> None:
    """Two full (model, optimizer) states are equal bit for bit, param groups included."""
    (ma, oa), (mb, ob) = a, b
    assert ma.keys() == mb.keys()
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k
    assert oa["state"].keys() == ob["state"].keys()
    for fqn, st in oa["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(ob["state"][fqn][k])), (fqn, k)
    assert oa["param_groups"] == ob["param_groups"]


def full_state(model, opt) -> tuple[dict, dict]:
    """``zf.get_state_dict(model, opt, full=True)``, copied (the step counters are the
    optimizer's own), in the form ``assert_same_state`` compares."""
    msd, osd = zf.get_state_dict(model, opt, full=True)
    return ({k: v.clone() for k, v in msd.items()},
            {"state": {f: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
                       for f, st in osd["state"].items()},
             "param_groups": osd["param_groups"]})
