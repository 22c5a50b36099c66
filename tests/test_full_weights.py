"""zf.full_weights: the full weights in buckets, one gather per bucket, equal bit for bit
to get_state_dict(full=True) at every stage and offload; to one rank or all; bad
arguments refused before any collective."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import zerofn as zf
from zerofn.io import weights
from support.errors import expect_error
from support.hooked import hooked_batches, hooked_model, train as train_hooked
from support.loops import build_parity, train_sharded
from support.models import batches
from support.ranks import run_ranks

OFFLOADS = ["none", "cpu", "nvme", "int8-bf16"]


def offload(kind: str, swap: str) -> list:
    os.makedirs(swap, exist_ok=True)
    return {"none": [], "cpu": [zf.offload("cpu")], "nvme": [zf.offload("nvme", path=swap)],
            "int8-bf16": [zf.offload("cpu", state_dtype=torch.int8,
                                     master_dtype=torch.bfloat16),
                          zf.mixed_precision(torch.bfloat16)]}[kind]


def buckets_of(full: dict, bucket_bytes: int) -> int:
    """How many buckets the full tensors fill, greedily in order (a larger one alone)."""
    count, size = 0, 0
    for t in full.values():
        n = t.numel() * t.element_size()
        if count == 0 or size + n > bucket_bytes:
            count, size = count + 1, 0
        size += n
    return count


def stream_out(rank, world, root, stage, kind, to):
    model, opt = build_parity(stage, "adamw", *offload(kind, os.path.join(root, "swap")))
    train_sharded(model, opt, batches(2, 1, world), rank, world)
    bucket = 1 << 16
    calls = []
    gather, all_gather = dist.gather, dist.all_gather
    dist.gather = lambda *a, **k: calls.append(1) or gather(*a, **k)
    dist.all_gather = lambda *a, **k: calls.append(1) or all_gather(*a, **k)
    try:
        got = list(zf.full_weights(model, bucket_bytes=bucket, to=to))
    finally:
        dist.gather, dist.all_gather = gather, all_gather
    expected = zf.get_state_dict(model, opt, full=True)[0]
    if to != "all" and rank != to:
        return got == [], len(calls), buckets_of(expected, bucket)
    same = [n for n, _ in got] == list(expected) and all(
        t.dtype == expected[n].dtype and torch.equal(t, expected[n]) for n, t in got)
    return same, len(calls), buckets_of(expected, bucket)


# (stage, offload, to): every stage and offload to all ranks, and ZeRO-3 on NVMe to rank 1
CASES = [(stage, kind, "all") for stage in (1, 2, 3) for kind in OFFLOADS] + [(3, "nvme", 1)]


def streams_out(rank, world, root, cases):
    return [stream_out(rank, world, os.path.join(root, str(i)), *case)
            for i, case in enumerate(cases)]


@pytest.fixture(scope="module")
def streamed(tmp_path_factory) -> dict:
    """Every case of CASES from one launch of two ranks: its results, a list over ranks."""
    root = str(tmp_path_factory.mktemp("full_weights"))
    per_rank = run_ranks(2, streams_out, root, CASES, timeout=400)
    return {case: [r[i] for r in per_rank] for i, case in enumerate(CASES)}


@pytest.mark.parametrize("kind", OFFLOADS)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_full_weights_equal_the_full_state_dict(streamed, stage, kind):
    for same, calls, buckets in streamed[stage, kind, "all"]:
        assert same
        assert calls == buckets > 3       # one gather per bucket


def test_full_weights_to_one_rank(streamed):
    results = streamed[3, "nvme", 1]
    assert [r[0] for r in results] == [True, True]     # rank 0 got nothing, rank 1 all
    assert results[0][1] == results[0][2]


def bf16_out(rank, world):
    model, opt = build_parity(3, "adamw")
    expected = zf.get_state_dict(model, opt, full=True)[0]
    got = dict(zf.full_weights(model, dtype=torch.bfloat16))
    return all(got[n].dtype == (torch.bfloat16 if t.is_floating_point() else t.dtype)
               and torch.equal(got[n], t.to(got[n].dtype)) for n, t in expected.items())


def test_full_weights_in_another_dtype():
    assert run_ranks(2, bf16_out) == [True, True]


def bad_arguments(rank, world):
    model, _ = build_parity(3, "adamw")
    for kwargs, text in [({"bucket_bytes": 0}, "bucket_bytes=0"),
                         ({"dtype": torch.int8}, "floating-point"),
                         ({"to": 2}, "0 to 1")]:
        expect_error([text], lambda: zf.full_weights(model, **kwargs))
    return True


def test_full_weights_refuses_bad_arguments():
    assert run_ranks(2, bad_arguments) == [True, True]


def hooked_out(rank, world, root):
    model, opt = hooked_model()
    model, opt = zf.compose(zf.shard_params(),
                            *offload("nvme", os.path.join(root, "swap")))(model, opt)
    train_hooked(model, opt, hooked_batches(2, world), rank, world)
    expected = zf.get_state_dict(model, opt, full=True)[0]
    got = list(zf.full_weights(model, bucket_bytes=1 << 10))
    return [n for n, _ in got] == list(expected) and all(
        torch.equal(t, expected[n]) for n, t in got)


def test_full_weights_take_the_names_hooks_give(tmp_path):
    """A fused projection saved in pieces comes out in its pieces, under their names."""
    assert run_ranks(2, hooked_out, str(tmp_path)) == [True, True]


def sent_where_they_lie(rank, world):
    """ZeRO-3's masters in one bucket: sent from their flat buffer, not packed; the
    parity model's uneven rows (97 of the embedding, 3 of ``gain``: an empty shard at
    world 4) come out whole all the same."""
    model, opt = build_parity(3, "adamw")
    train_sharded(model, opt, batches(2, 1, world), rank, world)
    packed = []
    plain = weights._packed
    weights._packed = lambda *a: packed.append(1) or plain(*a)
    try:
        got = dict(zf.full_weights(model, bucket_bytes=1 << 30))
    finally:
        weights._packed = plain
    expected = zf.get_state_dict(model, opt, full=True)[0]
    same = list(got) == list(expected) and all(torch.equal(got[n], t)
                                               for n, t in expected.items())
    return same, len(packed)


@pytest.mark.parametrize("world", [2, 4])
def test_zero3_masters_are_sent_where_they_lie(world):
    assert run_ranks(world, sent_where_they_lie) == [(True, 0)] * world
