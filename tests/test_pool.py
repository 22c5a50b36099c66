"""The buffer pool serves a request from the smallest free buffer large enough, within a
waste bound, so buffers of different units are shared instead of kept per size."""
from __future__ import annotations

import torch

from zerofn.runtime.pool import MAX_WASTE, BufferPool

CPU = torch.device("cpu")


def test_a_freed_larger_buffer_serves_a_smaller_request():
    pool = BufferPool()
    big = pool.take(1000, torch.float32, CPU)
    pool.give(big)
    small = pool.take(800, torch.float32, CPU)
    assert small.numel() == 800 and small.data_ptr() == big.data_ptr()
    assert pool.nbytes() == 4000           # nothing new was allocated


def test_the_smallest_fitting_buffer_is_chosen():
    pool = BufferPool()
    a, b = pool.take(1000, torch.float32, CPU), pool.take(600, torch.float32, CPU)
    pool.give(a)
    pool.give(b)
    assert pool.take(500, torch.float32, CPU).data_ptr() == b.data_ptr()
    assert pool.take(700, torch.float32, CPU).data_ptr() == a.data_ptr()


def test_waste_is_bounded_and_dtypes_do_not_mix():
    pool = BufferPool()
    limit = int(100 * MAX_WASTE)
    big = pool.take(limit + 1, torch.float32, CPU)
    pool.give(big)
    assert pool.take(100, torch.float32, CPU).data_ptr() != big.data_ptr()
    assert pool.take(limit + 1, torch.bfloat16, CPU).dtype == torch.bfloat16
    assert pool.take(limit + 1, torch.float32, CPU).data_ptr() == big.data_ptr()


def test_a_view_given_back_frees_its_whole_buffer():
    pool = BufferPool()
    big = pool.take(1000, torch.float32, CPU)
    pool.give(big)
    view = pool.take(900, torch.float32, CPU)
    pool.give(view)
    assert pool.take(1000, torch.float32, CPU).data_ptr() == big.data_ptr()
    assert pool.nbytes() == 4000


def test_empty_requests_need_no_buffer():
    pool = BufferPool()
    pool.give(pool.take(0, torch.float32, CPU))
    assert pool.nbytes() == 0


class FakeEvent:
    """Stands for a CUDA event: records which streams were made to wait for it."""

    def __init__(self):
        self.waited_by = []

    def wait(self, stream=None):
        self.waited_by.append(stream)


def test_a_buffer_freed_on_a_side_stream_is_waited_for_once_by_its_next_taker():
    pool = BufferPool()
    a = pool.take(1000, torch.float32, CPU)
    ready = FakeEvent()
    pool.give(a, ready)
    again = pool.take(1000, torch.float32, CPU, stream="side")
    assert again.data_ptr() == a.data_ptr() and ready.waited_by == ["side"]
    pool.give(again)                         # its last use was on the taker's stream
    pool.take(1000, torch.float32, CPU)
    assert ready.waited_by == ["side"]


def test_expected_sizes_make_a_smaller_request_s_buffer_fit_the_larger_one():
    pool = BufferPool()
    pool.expect([1000, 5000])               # 5000 is beyond MAX_WASTE of an 800 request
    root = pool.take(800, torch.float32, CPU)
    assert root.numel() == 800 and pool.nbytes() == 4000
    pool.give(root)
    block = pool.take(1000, torch.float32, CPU)
    assert block.data_ptr() == root.data_ptr() and pool.nbytes() == 4000
    assert pool.take(100, torch.float32, CPU).numel() == 100 and pool.nbytes() == 4400
