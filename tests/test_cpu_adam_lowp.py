"""zerofn.optim low-precision state: the torch reference (codes, 8-bit blocks, stochastic
rounding), the C++ kernels against it bit for bit, and CPUAdam's int8/bf16 state."""
import copy

import pytest
import torch

import zerofn.optim as zo
from zerofn.optim import lowp

# ------------------------------------------------------------------ reference


def py_mix32(x):
    """lowbias32 on Python ints, written independently of lowp.mix32."""
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def test_mix32_and_stream_keys_follow_the_documented_formula():
    xs = [0, 1, 2, 0x7FFFFFFF, 0xFFFFFFFF, 123456789]
    assert [lowp.mix32(x) for x in xs] == [py_mix32(x) for x in xs]
    assert lowp.mix32(torch.tensor(xs)).tolist() == [py_mix32(x) for x in xs]
    seed, step = 0x1234_5678_9ABC_DEF0, 77
    key = py_mix32(py_mix32(py_mix32(seed & 0xFFFFFFFF) ^ (seed >> 32)) ^ step)
    for stream in range(3):
        ks = py_mix32(key ^ ((0x9E3779B9 * (stream + 1)) & 0xFFFFFFFF))
        assert lowp.stream_key(seed, step, stream) == ks
        bits = lowp.random_bits(5, seed=seed, step=step, stream=stream, start=2**32 - 2)
        assert bits.tolist() == [py_mix32((i + ks) & 0xFFFFFFFF) for i in range(2**32 - 2, 2**32 + 3)]


def bnb_style_map(signed):
    """bitsandbytes' create_dynamic_map, in fp32 as it computes it."""
    data = [0.0, 1.0]
    for i in range(7):
        k = 2**i if signed else 2 ** (i + 1)
        b = torch.linspace(0.1, 1, k + 1)
        means = (b[:-1] + b[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-6 + i)) * means).tolist()
    return torch.tensor(sorted(data))


@pytest.mark.parametrize("signed", [True, False])
def test_codes_are_the_dynamic_tree_map(signed):
    c = lowp.signed_code() if signed else lowp.unsigned_code()
    assert c.dtype == torch.float32 and c.numel() == 256
    assert bool((c[1:] > c[:-1]).all())
    assert c[-1] == 1.0
    if signed:   # bitsandbytes' but for its most negative value, -1.0 (not -0.99296875)
        assert (c == 0).sum() == 1 and c[0] == -1.0
        assert torch.equal(-c[1:127].flip(0), c[128:254])
    else:        # bitsandbytes' but for its 0: exp_avg_sq's code has none
        assert c[0] == torch.tensor(0.55e-7) and (c == 0).sum() == 0
    ulp = torch.nextafter(c.abs(), torch.tensor(2.0)) - c.abs()
    assert bool(((c - bnb_style_map(signed)).abs() <= 2 * ulp)[1:].all())
    mids = lowp.midpoints(signed)
    assert mids.numel() == 255 and bool((c[:-1] < mids).all() and (mids < c[1:]).all())


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n", [1, 255, 256, 257, 1000])
def test_quantize_blockwise_picks_the_nearest_code(signed, n):
    torch.manual_seed(n)
    x = torch.randn(n) * torch.rand(n) ** 6
    x = x if signed else x.abs()
    q, s = lowp.quantize_blockwise(x, signed)
    assert q.dtype == torch.uint8 and q.numel() == n
    assert s.dtype == torch.float32 and s.numel() == -(-n // 256)
    blocks = torch.nn.functional.pad(x, (0, -n % 256)).view(-1, 256)
    assert torch.equal(s, blocks.abs().amax(1))
    code = lowp.signed_code() if signed else lowp.unsigned_code()
    norm = (x / s.repeat_interleave(256)[:n]).double()
    dist = (norm[:, None] - code.double()[None, :]).abs()
    chosen = (norm - code.double()[q.long()]).abs()
    assert torch.equal(chosen, dist.min(1).values)  # nearest (a tie can go either way)
    d = lowp.dequantize_blockwise(q, s, signed)
    q2, _ = lowp.quantize_blockwise(d, signed)
    assert torch.equal(q, q2)  # decoded values re-encode to the same codes


def test_quantize_edges():
    x = torch.zeros(300)
    x[256:] = torch.tensor([-2.0] + [0.0] * 43)
    q, s = lowp.quantize_blockwise(x, True)
    assert s.tolist() == [0.0, 2.0]
    zero = int((lowp.signed_code() == 0).nonzero())
    assert bool((q[:256] == zero).all()) and q[256] == 0  # -1 -> the most negative code
    mids = lowp.midpoints(False)
    on_mid = torch.cat([mids[:10], torch.tensor([1.0])])
    assert lowp.quantize_blockwise(on_mid, False)[0][:10].tolist() == list(range(10))


def test_quantize_blocks_with_a_subnormal_absmax():
    """1 / absmax overflows fp32 below 2**-128: such a block is scaled by 2**24 first, so
    it still normalizes to about 1 (its absmax takes the code of 1.0, zeros that of 0)."""
    x = torch.zeros(512)
    x[:3] = torch.tensor([3e-40, -1e-41, 1e-45])
    x[256:259] = torch.tensor([-2e-39, 1e-39, 0.0])
    for signed in (True, False):
        y = x if signed else x.abs()
        q, s = lowp.quantize_blockwise(y, signed)
        code = lowp.signed_code() if signed else lowp.unsigned_code()
        assert s.tolist() == [y[:256].abs().max().item(), y[256:].abs().max().item()]
        norm = y.double() / s.double().repeat_interleave(256)
        nearest = (norm[:, None] - code.double()[None, :]).abs().argmin(1)
        assert torch.equal(q.long(), nearest)


def test_unsigned_requantization_of_decoded_state_is_exact():
    """exp_avg_sq's block max decodes to exactly its scale (code 1.0), so decoding and
    re-encoding (a state dict round trip) gives back the same codes and scales."""
    torch.manual_seed(0)
    v = torch.rand(5000) ** 4 * 1e-3
    q, s = lowp.quantize_blockwise(v, False)
    q2, s2 = lowp.quantize_blockwise(lowp.dequantize_blockwise(q, s, False), False)
    assert torch.equal(q, q2) and torch.equal(s, s2)


@pytest.mark.parametrize("high", [False, True])
def test_stochastic_rounding_is_unbiased_and_deterministic(high):
    x = torch.full((200_000,), 1.0 + 2**-9)  # 1/4 of the way from 1.0 to the next bf16
    x[1::2] *= -1
    r = lowp.round_bf16_stochastic(x, seed=3, step=1, stream=0, high=high).float()
    assert set(r.abs().unique().tolist()) == {1.0, 1.0 + 2**-7}
    for half in (r[0::2], -r[1::2]):
        assert abs(half.mean().item() - (1.0 + 2**-9)) < 2e-5  # 5 sigma of 2**-7 * 0.43/300
    again = lowp.round_bf16_stochastic(x, seed=3, step=1, stream=0, high=high)
    assert torch.equal(again.view(torch.int16), r.bfloat16().view(torch.int16))
    for other in (dict(seed=4, step=1, stream=0, high=high), dict(seed=3, step=2, stream=0, high=high),
                  dict(seed=3, step=1, stream=1, high=high),
                  dict(seed=3, step=1, stream=0, high=not high)):  # fmt: skip
        assert not torch.equal(lowp.round_bf16_stochastic(x, **other).float(), r)
    # The two halves of one stream round independently: up together 1/4 x 1/4 of the time.
    other = lowp.round_bf16_stochastic(x, seed=3, step=1, stream=0, high=not high).float()
    both_up = ((r.abs() > 1.0) & (other.abs() > 1.0)).float().mean().item()
    assert abs(both_up - 1 / 16) < 3e-3  # ~5 sigma of sqrt(1/16 * 15/16 / 200_000)


def test_stochastic_rounding_specials():
    special = torch.tensor([0.0, -0.0, 1.0, float("inf"), -float("inf"), float("nan"),
                            -float("nan"), 3.0e38, 1e-40])  # fmt: skip
    x = special.repeat(1000)
    r = lowp.round_bf16_stochastic(x, seed=1, step=1, stream=2).float().view(1000, -1)
    assert bool((r[:, :3] == special[:3]).all()) and bool((r[:, 1].view(torch.int32) < 0).all())
    assert bool((r[:, 3] == float("inf")).all()) and bool((r[:, 4] == -float("inf")).all())
    assert bool(r[:, 5:7].isnan().all()) and bool((r[:, 6].view(torch.int32) < 0).all())
    assert bool((r[:, 7] > 2.9e38).all()) and bool((r[:, 8] >= 0).all())


# ------------------------------------------------------------ kernels, bit for bit

ISAS = zo.kernel_info()["available_isas"]
F32, BF16, F16, U8 = torch.float32, torch.bfloat16, torch.float16, torch.uint8


@pytest.fixture(autouse=True)
def _quiet_generic_warning(monkeypatch):
    from zerofn.optim import kernels

    monkeypatch.setattr(kernels, "_warned_generic", True)


def make_state(n, master, state, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g).to(master)
    m, v = torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.01
    if state == U8:
        (m, ms), (v, vs) = lowp.quantize_blockwise(m, True), lowp.quantize_blockwise(v, False)
        return [p, m, v, ms, vs]
    return [p, m.to(state), v.to(state), None, None]


def run_both(n, grad, master, state, out, adamw, steps=3, threads=None):
    """Steps the kernel and the reference on copies of one state; returns both."""
    ours = make_state(n, master, state)
    ref = [None if t is None else t.clone() for t in ours]
    outs = [None if out is None else torch.empty(n, dtype=out) for _ in range(2)]
    gen = torch.Generator().manual_seed(1)
    before = torch.get_num_threads()
    try:
        if threads:
            torch.set_num_threads(threads)
        for step in range(1, steps + 1):
            g = torch.randn(n, generator=gen).to(grad)
            kw = dict(step=step, lr=1e-2, weight_decay=0.1, adamw_mode=adamw, grad_scale=0.5,
                      seed=2**40 + 7)  # fmt: skip
            for fn, b, o in ((zo.adam_step, ours, outs[0]), (zo.reference_adam_step, ref, outs[1])):
                fn(b[0], g, b[1], b[2], out=o, exp_avg_scale=b[3], exp_avg_sq_scale=b[4], **kw)
    finally:
        torch.set_num_threads(before)
    return ours + [outs[0]], ref + [outs[1]]


def assert_bits_equal(ours, ref):
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a is not None:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"buffer {i} differs"


COMBOS = [(g, p, s, o, w) for g in (F32, BF16, F16) for p in (F32, BF16) for s in (F32, BF16, U8)
          for o in (None, BF16, F16) for w in (True, False)]  # fmt: skip


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad, master, state, out, adamw", COMBOS)
def test_kernel_equals_reference_bit_for_bit(isa, grad, master, state, out, adamw):
    zo.set_isa(isa)
    try:
        for n in (1, 15, 255, 256, 257, 1000, 4099):
            assert_bits_equal(*run_both(n, grad, master, state, out, adamw))
    finally:
        zo.set_isa(ISAS[0])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("master, state", [(F32, U8), (BF16, U8), (BF16, BF16), (F32, F32)])
@pytest.mark.parametrize("half", [BF16, F16])
def test_the_copy_out_may_overwrite_the_gradients_in_place(isa, master, state, half):
    """Offload's host ring writes a unit's updated rows over its gradients: the same bits
    as a separate copy, the tails and short last blocks included."""
    zo.set_isa(isa)
    try:
        for n in (15, 257, 1000, 4099):
            apart, inplace = make_state(n, master, state), make_state(n, master, state)
            g = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(half)
            out, rows = torch.empty(n, dtype=half), g.clone()
            for b, o, grads in ((apart, out, g), (inplace, rows, rows)):
                zo.adam_step(b[0], grads, b[1], b[2], out=o, exp_avg_scale=b[3],
                             exp_avg_sq_scale=b[4], step=2, lr=1e-2, grad_scale=0.5, seed=5)
            assert_bits_equal(apart + [out], inplace + [rows])
    finally:
        zo.set_isa(ISAS[0])


@pytest.mark.parametrize("isa", ISAS)
def test_kernel_encodes_subnormal_blocks_like_the_reference(isa):
    """Moments so small that a block's absmax is subnormal (exp_avg_sq of a long-idle
    parameter): the kernels' per-block reciprocal takes the same 2**24 detour."""
    n = 700
    gen = torch.Generator().manual_seed(3)
    m, ms = lowp.quantize_blockwise(torch.randn(n, generator=gen) * 1e-41, True)
    v, vs = lowp.quantize_blockwise(torch.rand(n, generator=gen) * 1e-41, False)
    ours = [torch.randn(n, generator=gen), m, v, ms, vs]
    ref = [t.clone() for t in ours]
    zo.set_isa(isa)
    try:
        for step, g in enumerate((torch.zeros(n), torch.randn(n, generator=gen) * 1e-41), 1):
            for fn, b in ((zo.adam_step, ours), (zo.reference_adam_step, ref)):
                fn(b[0], g, b[1], b[2], step=step, lr=1e-3, exp_avg_scale=b[3],
                   exp_avg_sq_scale=b[4])
            assert_bits_equal(ours, ref)
            assert bool((ref[3] < 2.0**-128).all() and (ref[4] < 2.0**-128).all())
    finally:
        zo.set_isa(ISAS[0])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_diverged_block_codes_as_the_reference_does(isa, bad):
    """A gradient of inf or nan (training diverged, nothing to skip the step) makes its
    block's new moments non-finite: the block's scale becomes nan or inf as torch's amax
    has it and every code the reference's, where the code search once read past its table."""
    n = 3 * 256 + 40
    gen = torch.Generator().manual_seed(4)
    ours = make_state(n, F32, U8)
    ref = [t.clone() for t in ours]
    g = torch.randn(n, generator=gen)
    g[300], g[n - 3] = bad, bad           # a whole block and the short last one
    zo.set_isa(isa)
    try:
        for fn, b in ((zo.adam_step, ours), (zo.reference_adam_step, ref)):
            fn(b[0], g, b[1], b[2], step=1, lr=1e-3, exp_avg_scale=b[3], exp_avg_sq_scale=b[4])
    finally:
        zo.set_isa(ISAS[0])
    for a, b in zip(ours, ref):
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a.nan_to_num().view(torch.uint8), b.nan_to_num().view(torch.uint8))
    assert ref[3][1].isnan() or ref[3][1].isinf()    # (the test reaches the diverged path)


@pytest.mark.parametrize("master, state", [(F32, U8), (BF16, U8), (BF16, BF16), (F32, F32)])
@pytest.mark.parametrize("threads", [1, 2])
def test_thread_split_keeps_blocks_and_random_bits(master, state, threads):
    """Several pieces (n > 2 x 32K elements): pieces start on 8-bit blocks and count
    random bits from the buffer's start, so the result equals the reference."""
    assert_bits_equal(*run_both(3 * 2**15 + 333, BF16, master, state, BF16, True, steps=2,
                                threads=threads))  # fmt: skip


def test_bf16_exp_avg_sq_decays_under_stochastic_rounding():
    """With zero gradients v *= beta2 each step: 0.999 is less than half a bf16 ulp of
    change, so round-to-nearest would keep v forever; stochastic rounding decays it."""
    n, steps = 4096, 200
    p, g = torch.zeros(n), torch.zeros(n, dtype=BF16)
    m, v = torch.zeros(n, dtype=BF16), torch.ones(n, dtype=BF16)
    for step in range(1, steps + 1):
        zo.adam_step(p, g, m, v, step=step, lr=0.0, beta2=0.999)
    assert abs(v.float().mean().item() - 0.999**steps) < 0.01
    assert v.float().mean().item() < 0.9  # RNE: 1.0


def test_bf16_masters_accumulate_small_updates():
    """lr * update below half a bf16 ulp: RNE masters would never move; SR moves them
    by the right amount on average."""
    n = 8192
    p = torch.ones(n, dtype=BF16)
    m, v = torch.zeros(n), torch.zeros(n)
    g = torch.ones(n)
    for step in range(1, 51):
        zo.adam_step(p, g, m, v, step=step, lr=1e-4, beta2=0.999, eps=1e-8)
    assert abs(p.float().mean().item() - (1 - 50 * 1e-4)) < 2e-4


def test_lowp_argument_errors():
    n = 300
    p, g = torch.zeros(n), torch.zeros(n)
    m8, v8 = torch.zeros(n, dtype=U8), torch.zeros(n, dtype=U8)
    s = torch.zeros(2)
    with pytest.raises(ValueError, match="exp_avg_scale"):
        zo.adam_step(p, g, m8, v8, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="need 2"):
        zo.adam_step(p, g, m8, v8, step=1, lr=1e-3, exp_avg_scale=torch.zeros(1),
                     exp_avg_sq_scale=s.clone())  # fmt: skip
    with pytest.raises(TypeError, match="dtype"):
        zo.adam_step(p, g, m8, torch.zeros(n), step=1, lr=1e-3, exp_avg_scale=s,
                     exp_avg_sq_scale=s.clone())  # fmt: skip
    with pytest.raises(ValueError, match="only for uint8"):
        zo.adam_step(p, g, torch.zeros(n), torch.zeros(n), step=1, lr=1e-3, exp_avg_scale=s)
    with pytest.raises(TypeError, match="dtype"):
        zo.adam_step(p.half(), g, torch.zeros(n), torch.zeros(n), step=1, lr=1e-3)
    with pytest.raises(ValueError, match="seed"):
        zo.adam_step(p, g, torch.zeros(n), torch.zeros(n), step=1, lr=1e-3, seed=-1)


# --------------------------------------------------------------------- CPUAdam


def params(dtype=F32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype))
            for s in ((67, 71), (4099,), (7,))]  # fmt: skip


def train(opt, ps, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


def bits(ps):
    return [p.detach().clone().view(torch.uint8) for p in ps]


@pytest.mark.parametrize("state_dtype", [F32, BF16, torch.int8])
@pytest.mark.parametrize("master", [F32, BF16])
def test_cpuadam_lowp_tracks_fp32_adamw(state_dtype, master):
    ps, ref = params(master), params()
    opt = zo.CPUAdam(ps, lr=1e-2, state_dtype=state_dtype)
    train(opt, ps, 20)
    train(torch.optim.AdamW(ref, lr=1e-2), ref, 20)
    tol = 0.05 if master == F32 else 0.15  # bf16 masters: a random walk of ~1 ulp steps
    for p, r in zip(ps, ref):
        err = (p.detach().float() - r.detach()).abs()  # 20 steps of lr 1e-2 move ~0.2
        assert err.max().item() < tol and err.mean().item() < tol / 5
    if state_dtype == torch.int8:
        st = opt.state[ps[1]]
        assert st["exp_avg"].dtype == U8 and st["exp_avg_scale"].numel() == 17
        # (a parameter under 4096 elements keeps fp32 moments, as bitsandbytes' do)
        assert opt.state[ps[2]]["exp_avg"].dtype == F32 and "exp_avg_scale" not in opt.state[ps[2]]


@pytest.mark.parametrize("state_dtype", [BF16, torch.int8])
def test_cpuadam_state_dict_moves_to_torch_and_back(state_dtype):
    ps = params()
    opt = zo.CPUAdam(ps, lr=1e-2, state_dtype=state_dtype)
    train(opt, ps, 5)
    sd = opt.state_dict()
    st = sd["state"][0]
    assert st["exp_avg"].dtype == F32 and st["exp_avg"].shape == ps[0].shape
    assert "exp_avg_scale" not in st
    torch_opt = torch.optim.AdamW(ps, lr=1e-2)
    torch_opt.load_state_dict(sd)
    assert torch.equal(torch_opt.state[ps[0]]["exp_avg"], st["exp_avg"])
    back = zo.CPUAdam(ps, lr=1e-2, state_dtype=torch.int8)
    back.load_state_dict(torch_opt.state_dict())
    b = back.state[ps[0]]
    assert b["exp_avg"].dtype == U8 and b["exp_avg_sq_scale"].dtype == F32
    assert (back.state_dict()["state"][0]["exp_avg"] - st["exp_avg"]).abs().max() <= (
        0.02 * st["exp_avg"].abs().max())  # fmt: skip
    train(back, ps, 2)


@pytest.mark.parametrize("state_dtype, raw", [(BF16, False), (torch.int8, True), (F32, False)])
@pytest.mark.parametrize("master", [F32, BF16])
def test_resume_is_bit_identical(state_dtype, raw, master):
    """A run resumed from a state dict rounds exactly as the uninterrupted one: the
    random bits depend on seed, parameter index and step only. bf16 moments survive
    the fp32 state dict exactly; 8-bit ones need raw=True (an exp_avg block whose
    largest magnitude is negative decodes to less than its scale)."""
    a, b = params(master), params(master)
    opt_a = zo.CPUAdam(a, lr=1e-2, state_dtype=state_dtype, seed=5)
    train(opt_a, a, 4)
    sd = copy.deepcopy(opt_a.state_dict(raw=raw))  # as saved: shares no tensor with opt_a
    for pb, pa in zip(b, a):
        pb.data.copy_(pa.detach())
    opt_b = zo.CPUAdam(b, lr=1e-2, state_dtype=state_dtype, seed=5)
    opt_b.load_state_dict(sd)
    train(opt_a, a, 3, seed=9)
    train(opt_b, b, 3, seed=9)
    for x, y in zip(bits(a), bits(b)):
        assert torch.equal(x, y)
    for pa, pb in zip(a, b):
        for key in opt_a.state[pa]:
            assert torch.equal(opt_a.state[pa][key], opt_b.state[pb][key]), key


def test_cpuadam_lowp_options_are_checked():
    with pytest.raises(ValueError, match="state_dtype"):
        zo.CPUAdam(params(), state_dtype=torch.float16)
    with pytest.raises(ValueError, match="master_dtype"):
        zo.CPUAdam(params(), master_dtype=BF16)
    with pytest.raises(ValueError, match="amsgrad"):
        zo.CPUAdam(params(), amsgrad=True, state_dtype=torch.int8)
    zo.CPUAdam(params(BF16), master_dtype=BF16)


def test_parameters_round_with_different_streams():
    """Two parameters with equal values and gradients still draw different bits."""
    ps = [torch.nn.Parameter(torch.ones(4096, dtype=BF16)) for _ in range(2)]
    opt = zo.CPUAdam(ps, lr=1e-3, weight_decay=0.0)
    for p in ps:
        p.grad = torch.full((4096,), 0.3, dtype=BF16)
    opt.step()
    assert not torch.equal(ps[0].detach(), ps[1].detach())
