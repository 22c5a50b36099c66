"""zerofn.optim: C++ CPU Adam against torch.optim, its fused pipeline and its guards."""
import math
import struct

import pytest
import torch

import zerofn.optim as zo
from support.compare import worst
from zerofn.optim import kernels

ISAS = zo.kernel_info()["available_isas"]
SHAPES = [(37, 53), (1003,), (7,), (16,)]  # body + tail for every vector width, tiny ones


@pytest.fixture(params=ISAS)
def isa(request):
    """Runs a test once per instruction set this CPU has, restoring the best after."""
    zo.set_isa(request.param)
    yield request.param
    zo.set_isa(ISAS[0])


@pytest.fixture(autouse=True)
def _quiet_generic_warning(monkeypatch):
    monkeypatch.setattr(kernels, "_warned_generic", True)


def assert_rel(actual, expected, tol=1e-6):
    """Max error within tol of the tensor's scale: elementwise relative error is
    meaningless where an Adam parameter or moment crosses zero."""
    scale = expected.abs().max().item()
    err = worst(actual - expected)
    assert err <= tol * scale, f"max error {err:.3g} > {tol} x scale {scale:.3g}"


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def set_grad(p, grad):
    """Low-precision grads on fp32 params need torch's opt-in (grad_dtype, 2.10+)."""
    if grad.dtype != p.dtype:
        if not hasattr(p, "grad_dtype"):
            pytest.skip("this torch cannot hold a gradient of another dtype")
        p.grad_dtype = None
    p.grad = grad


def train(opt, params, steps, grad_dtype=torch.float32, seed=1):
    """Steps opt on a seeded gradient stream; the same seed gives the same gradients."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            grad = torch.randn(p.shape, generator=g).to(grad_dtype)
            if not isinstance(opt, zo.CPUAdam):
                grad = grad.float()  # torch's reference gets the upcast gradient
            set_grad(p, grad)
        opt.step()


def run_pair(ours, ref, params_ours, params_ref, steps, grad_dtype, seed=1):
    train(ours, params_ours, steps, grad_dtype, seed)
    train(ref, params_ref, steps, grad_dtype, seed)


def assert_same_training(ours, ref, params_ours, params_ref, tol=1e-6):
    for po, pr in zip(params_ours, params_ref):
        assert_rel(po.detach(), pr.detach(), tol)
        so, sr = ours.state[po], ref.state[pr]
        assert so["step"].item() == sr["step"].item()
        assert_rel(so["exp_avg"], sr["exp_avg"], tol)
        assert_rel(so["exp_avg_sq"], sr["exp_avg_sq"], tol)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adamw", [True, False])
def test_100_steps_match_torch(isa, grad_dtype, adamw):
    base = make_params()
    po = [torch.nn.Parameter(p.clone()) for p in base]
    pr = [torch.nn.Parameter(p.clone()) for p in base]
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    ours = zo.CPUAdam(po, adamw_mode=adamw, **hyper)
    ref = (torch.optim.AdamW if adamw else torch.optim.Adam)(pr, **hyper)
    run_pair(ours, ref, po, pr, 100, grad_dtype)
    assert_same_training(ours, ref, po, pr)


def test_small_beta1_and_groups_match_torch():
    """beta1 <= 0.5 takes torch's other lerp formula; groups keep their own settings,
    and a parameter without a gradient is left alone, as in torch."""
    base = make_params()
    po = [torch.nn.Parameter(p.clone()) for p in base]
    pr = [torch.nn.Parameter(p.clone()) for p in base]

    def groups(ps):
        return [dict(params=ps[:2], lr=3e-3, betas=(0.3, 0.9)),
                dict(params=ps[2:], lr=1e-2, weight_decay=0.0)]  # fmt: skip

    ours, ref = zo.CPUAdam(groups(po)), torch.optim.AdamW(groups(pr))
    run_pair(ours, ref, po, pr, 30, torch.float32)
    po[3].grad = pr[3].grad = None
    frozen = po[3].detach().clone()
    run_pair(ours, ref, po[:3], pr[:3], 10, torch.float32)
    assert torch.equal(po[3].detach(), frozen)
    assert_same_training(ours, ref, po, pr)


def test_isas_give_identical_bits():
    """Vector widths and the scalar path round identically (tails included)."""
    torch.manual_seed(0)
    n = 4099
    p, m = torch.randn(n), torch.randn(n) * 0.1
    v, g = torch.rand(n) * 0.01, torch.randn(n)
    results = {}
    for name in ISAS:
        zo.set_isa(name)
        outs = []
        for gd, od, adamw in [(torch.float32, torch.bfloat16, True),
                              (torch.bfloat16, torch.float16, False),
                              (torch.float16, torch.bfloat16, True)]:  # fmt: skip
            bufs = [p.clone(), m.clone(), v.clone()]
            low = torch.empty(n, dtype=od)
            zo.adam_step(bufs[0], g.to(gd), bufs[1], bufs[2], step=7, lr=1e-3,
                         weight_decay=0.1, adamw_mode=adamw, grad_scale=0.37, out=low)  # fmt: skip
            outs += bufs + [low.view(torch.int16)]
        results[name] = outs
    zo.set_isa(ISAS[0])
    for name in ISAS[1:]:
        for a, b in zip(results[ISAS[0]], results[name]):
            assert torch.equal(a, b), name


def bits_to_floats(words):
    return torch.tensor([struct.unpack("<f", struct.pack("<I", w))[0] for w in words])


SPECIAL = [
    0x3F808000, 0x3F818000, 0xBF808000, 0x3F80FFFF,  # bf16 ties (both ways), below a tie
    0x7F7FFFFF, 0xFF7FFFFF,  # largest floats: round up to inf in bf16 and fp16
    0x00000001, 0x00008000, 0x80018000, 0x007FFFFF,  # fp32 subnormals
    0x7F800000, 0xFF800000, 0x00000000, 0x80000000,  # infinities and zeros
    0x7FC00001, 0xFFC00000, 0x7F800001,  # quiet, negative and signalling NaN
    0x477FEFFF, 0x477FF000, 0x387FC000, 0x33000000, 0x33000001, 0x337FFFFF,  # fp16 edges
]


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_copy_out_rounds_like_torch(isa, out_dtype):
    """With lr=0 the update leaves params as they are, so `out` is their rounding."""
    torch.manual_seed(0)
    special = bits_to_floats(SPECIAL)
    params = torch.randn(1001) * 1e3
    params[: len(special)] = special
    params[-len(special) :] = special  # again in the tail of the vector loop
    params[500 : 500 + len(special)] = special
    p = params.clone()
    low = torch.empty(p.numel(), dtype=out_dtype)
    zo.adam_step(p, torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p),
                 step=1, lr=0.0, out=low)  # fmt: skip
    assert torch.equal(p.view(torch.int32), params.view(torch.int32))
    expected = params.to(out_dtype)
    nan = expected.isnan()
    assert torch.equal(low.isnan(), nan)
    assert torch.equal(low[~nan].view(torch.int16), expected[~nan].view(torch.int16))
    assert torch.equal(low[nan].float().view(torch.int32) < 0, params[nan].view(torch.int32) < 0)


def test_copy_out_after_training_equals_to_bfloat16():
    base = make_params()
    po = [torch.nn.Parameter(p.clone()) for p in base]
    low = {p: torch.empty(p.shape, dtype=torch.bfloat16) for p in po}
    opt = zo.CPUAdam(po, lr=1e-2)
    for _ in range(3):
        for p in po:
            p.grad = torch.randn(p.shape)
        opt.step(lowp_out=low)
        for p in po:
            assert torch.equal(low[p], p.detach().to(torch.bfloat16))


def test_state_dict_moves_to_torch_and_back():
    base = make_params()
    hyper = dict(lr=1e-2, weight_decay=0.1)
    plain = [torch.nn.Parameter(p.clone()) for p in base]  # torch for all 20 steps
    ref = torch.optim.AdamW(plain, **hyper)
    first = [torch.nn.Parameter(p.clone()) for p in base]  # CPUAdam, then torch
    second = [torch.nn.Parameter(p.clone()) for p in base]  # torch, then CPUAdam
    a, b = zo.CPUAdam(first, **hyper), torch.optim.AdamW(second, **hyper)
    train(ref, plain, 10, seed=1)
    train(a, first, 10, seed=1)
    train(b, second, 10, seed=1)
    assert set(a.state_dict()["param_groups"][0]) >= set(b.state_dict()["param_groups"][0])
    a2, b2 = torch.optim.AdamW(first, **hyper), zo.CPUAdam(second, **hyper)
    a2.load_state_dict(a.state_dict())
    b2.load_state_dict(b.state_dict())
    assert b2.param_groups[0]["decoupled_weight_decay"] is True
    train(ref, plain, 10, seed=2)
    train(a2, first, 10, seed=2)
    train(b2, second, 10, seed=2)
    assert_same_training(a2, ref, first, plain)
    assert_same_training(b2, ref, second, plain)


def test_clip_and_step_matches_unscale_clip_step_copy():
    base = make_params()
    po = [torch.nn.Parameter(p.clone()) for p in base]
    pr = [torch.nn.Parameter(p.clone()) for p in base]
    ours, ref = zo.CPUAdam(po, lr=1e-2), torch.optim.AdamW(pr, lr=1e-2)
    low = {p: torch.empty(p.shape, dtype=torch.bfloat16) for p in po}
    loss_scale, max_norm = 512.0, 2.0
    g = torch.Generator().manual_seed(3)
    for i in range(20):
        for a, b in zip(po, pr):
            grad = torch.randn(a.shape, generator=g) * (3.0 if i % 2 else 0.01)
            set_grad(a, (grad * loss_scale).to(torch.bfloat16))
            b.grad = a.grad.float() / loss_scale
        norm_ref = torch.nn.utils.clip_grad_norm_(pr, max_norm).item()
        ref.step()
        norm, stepped = ours.clip_and_step(max_norm, loss_scale=loss_scale, lowp_out=low)
        assert stepped and math.isclose(norm, norm_ref, rel_tol=1e-5)
    assert_same_training(ours, ref, po, pr, tol=2e-6)
    for p in po:
        assert torch.equal(low[p], p.detach().to(torch.bfloat16))


def test_overflow_skips_the_step():
    po = [torch.nn.Parameter(p) for p in make_params()]
    opt = zo.CPUAdam(po)
    for p in po:
        set_grad(p, torch.ones(p.shape, dtype=torch.float16))
    po[1].grad[-1] = math.inf  # in the tail of the last vector
    before = [p.detach().clone() for p in po]
    norm, stepped = opt.clip_and_step(1.0, loss_scale=2.0**16)
    assert (norm, stepped) == (math.inf, False)
    assert all(torch.equal(p.detach(), b) for p, b in zip(po, before))
    assert len(opt.state) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sumsq_and_finite(isa, dtype):
    torch.manual_seed(0)
    g = (torch.randn(200_003) * 3).to(dtype)  # several threads' pieces plus a tail
    sumsq, finite = zo.grad_sumsq_and_finite(g)
    assert finite and math.isclose(sumsq, g.double().square().sum().item(), rel_tol=1e-12)
    for pos in (0, 100_000, 200_002):
        for bad in (math.inf, -math.inf, math.nan):
            h = g.clone()
            h[pos] = bad
            assert zo.grad_sumsq_and_finite(h)[1] is False
    assert zo.grad_sumsq_and_finite(torch.zeros(0, dtype=dtype)) == (0.0, True)


def test_sumsq_of_huge_finite_values_is_finite():
    sumsq, finite = zo.grad_sumsq_and_finite(torch.full((1000,), 3e38))
    assert finite and math.isclose(sumsq, 1000 * 3e38**2, rel_tol=1e-6)


def test_flat_buffer_step_matches_reference_formula():
    """adam_step on a flat buffer with grad_scale and L2 equals torch.optim.Adam fed
    the scaled gradient, and its result does not depend on the thread count."""
    torch.manual_seed(0)
    n = 3 * 2**15 + 5
    p0, g = torch.randn(n), torch.randn(n)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.Adam([ref], lr=1e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.2)
    results, threads_before = [], torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        for step in (1, 2, 3):
            zo.adam_step(p, g, m, v, step=step, lr=1e-3, beta1=0.8, beta2=0.95, eps=1e-6,
                         weight_decay=0.2, adamw_mode=False, grad_scale=0.25)  # fmt: skip
        results.append((p, m, v))
    torch.set_num_threads(threads_before)
    for step in (1, 2, 3):
        ref.grad = g * 0.25
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert_rel(results[1][0], ref.detach())
    assert_rel(results[1][1], opt.state[ref]["exp_avg"])


def test_roofline_kernel_adds_scaled_grads():
    p, g, m, v = torch.ones(1000), torch.full((1000,), 1e3), torch.zeros(1000), torch.ones(1000)
    zo.adam_roofline(p, g, m, v)
    expected = torch.tensor(1e3 * 1e-7, dtype=torch.float32)
    assert torch.allclose(m, expected.expand(1000)) and torch.allclose(p, 1 + expected)


def test_empty_buffers_are_fine():
    e = torch.zeros(0)
    zo.adam_step(e, e.clone(), e.clone(), e.clone(), step=1, lr=1e-3)


def bufs(n=64):
    return [torch.zeros(n) for _ in range(4)]


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (lambda b: b.__setitem__(0, torch.zeros(8, 8).t()), ValueError, "contiguous"),
        (lambda b: b.__setitem__(0, torch.zeros(128)[::2]), ValueError, "contiguous"),
        (lambda b: b.__setitem__(1, torch.zeros(63)), ValueError, "elements"),
        (lambda b: b.__setitem__(2, torch.zeros(65)), ValueError, "elements"),
        (lambda b: b.__setitem__(0, torch.zeros(64, dtype=torch.float64)), TypeError, "dtype"),
        (lambda b: b.__setitem__(1, torch.zeros(64, dtype=torch.int32)), TypeError, "dtype"),
        (lambda b: b.__setitem__(3, torch.zeros(64, dtype=torch.bfloat16)), TypeError, "dtype"),
        (lambda b: b.__setitem__(0, torch.zeros(64, device="meta")), ValueError, "host"),
        (lambda b: b.__setitem__(1, [0.0] * 64), TypeError, "torch.Tensor"),
        (lambda b: b.__setitem__(2, b[3]), ValueError, "overlap"),
        (lambda b: b.__setitem__(2, b[0].view(torch.float32)[0:64]), ValueError, "overlap"),
    ],
)
def test_bad_buffers_raise(mutate, error, match):
    b = bufs()
    mutate(b)
    with pytest.raises(error, match=match):
        zo.adam_step(*b, step=1, lr=1e-3)


@pytest.mark.cuda
def test_cuda_tensor_raises():
    b = bufs()
    b[1] = b[1].cuda()
    with pytest.raises(ValueError, match="host"):
        zo.adam_step(*b, step=1, lr=1e-3)


def test_bad_out_and_hyperparameters_raise():
    b = bufs()
    with pytest.raises(TypeError, match="dtype"):
        zo.adam_step(*b, step=1, lr=1e-3, out=torch.zeros(64))
    with pytest.raises(ValueError, match="elements"):
        zo.adam_step(*b, step=1, lr=1e-3, out=torch.zeros(60, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="step"):
        zo.adam_step(*b, step=0, lr=1e-3)
    with pytest.raises(ValueError, match="betas"):
        zo.adam_step(*b, step=1, lr=1e-3, beta2=1.0)
    with pytest.raises(ValueError, match="finite"):
        zo.adam_step(*b, step=1, lr=math.nan)
    with pytest.raises(ValueError, match="not available"):
        zo.set_isa("avx9000")


def test_optimizer_rejects_what_it_cannot_step():
    with pytest.raises(ValueError, match="fp32 CPU"):
        zo.CPUAdam([torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))])
    with pytest.raises(ValueError, match="amsgrad"):
        zo.CPUAdam([torch.nn.Parameter(torch.zeros(4))], amsgrad=True)
    p = torch.nn.Parameter(torch.zeros(4, 4))
    opt = zo.CPUAdam([p])
    p.grad = torch.zeros(4, 4).t()
    with pytest.raises(ValueError, match="contiguous"):
        opt.step()


def test_missing_build_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(kernels, "_C", None)
    monkeypatch.setattr(kernels, "_IMPORT_ERROR", ImportError("no module zerofn._C"))
    with pytest.raises(RuntimeError, match="not built or failed to load"):
        zo.CPUAdam([torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(RuntimeError, match="pip install"):
        zo.grad_sumsq_and_finite(torch.zeros(4))


@pytest.mark.skipif("generic" not in ISAS or zo.kernel_info()["arch"] != "x86_64",
                    reason="the warning concerns x86-64 CPUs without AVX2")  # fmt: skip
def test_generic_path_on_x86_warns(monkeypatch):
    monkeypatch.setattr(kernels, "_warned_generic", False)
    zo.set_isa("generic")
    try:
        with pytest.warns(RuntimeWarning, match="scalar kernels"):
            zo.grad_sumsq_and_finite(torch.zeros(4))
    finally:
        zo.set_isa(ISAS[0])
