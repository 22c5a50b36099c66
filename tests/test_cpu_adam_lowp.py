"""zerofn.optim low-precision state: the torch reference (codes, 8-bit blocks, stochastic
rounding), the C++ kernels against it bit for bit, and CPUAdam's int8/bf16 state."""
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


def test_unsigned_requantization_of_decoded_state_is_exact():
    """exp_avg_sq's block max decodes to exactly its scale (code 1.0), so decoding and
    re-encoding (a state dict round trip) gives back the same codes and scales."""
    torch.manual_seed(0)
    v = torch.rand(5000) ** 4 * 1e-3
    q, s = lowp.quantize_blockwise(v, False)
    q2, s2 = lowp.quantize_blockwise(lowp.dequantize_blockwise(q, s, False), False)
    assert torch.equal(q, q2) and torch.equal(s, s2)


def test_stochastic_rounding_is_unbiased_and_deterministic():
    x = torch.full((200_000,), 1.0 + 2**-9)  # 1/4 of the way from 1.0 to the next bf16
    x[1::2] *= -1
    r = lowp.round_bf16_stochastic(x, seed=3, step=1, stream=0).float()
    assert set(r.abs().unique().tolist()) == {1.0, 1.0 + 2**-7}
    for half in (r[0::2], -r[1::2]):
        assert abs(half.mean().item() - (1.0 + 2**-9)) < 2e-5  # 5 sigma of 2**-7 * 0.43/300
    again = lowp.round_bf16_stochastic(x, seed=3, step=1, stream=0)
    assert torch.equal(again.view(torch.int16), r.bfloat16().view(torch.int16))
    for other in (dict(seed=4, step=1, stream=0), dict(seed=3, step=2, stream=0),
                  dict(seed=3, step=1, stream=1)):  # fmt: skip
        assert not torch.equal(lowp.round_bf16_stochastic(x, **other).float(), r)


def test_stochastic_rounding_specials():
    special = torch.tensor([0.0, -0.0, 1.0, float("inf"), -float("inf"), float("nan"),
                            -float("nan"), 3.0e38, 1e-40])  # fmt: skip
    x = special.repeat(1000)
    r = lowp.round_bf16_stochastic(x, seed=1, step=1, stream=2).float().view(1000, -1)
    assert bool((r[:, :3] == special[:3]).all()) and bool((r[:, 1].view(torch.int32) < 0).all())
    assert bool((r[:, 3] == float("inf")).all()) and bool((r[:, 4] == -float("inf")).all())
    assert bool(r[:, 5:7].isnan().all()) and bool((r[:, 6].view(torch.int32) < 0).all())
    assert bool((r[:, 7] > 2.9e38).all()) and bool((r[:, 8] >= 0).all())
