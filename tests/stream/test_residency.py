"""Which blocks stay resident (Note [resident blocks]): decisions of the pure function."""

import pytest

from tiermem.stream import plan_residency


def test_no_budget_streams_every_block():
    plan = plan_residency([10, 10, 10], gpu_bytes=None, prefetch_blocks=1)
    assert plan.streamed == (0, 1, 2) and plan.resident == ()
    assert plan.buffer_blocks == 3 and plan.buffer_bytes == 30


def test_the_last_blocks_stay_resident_while_they_fit_with_the_buffers():
    sizes = [10] * 6
    # prefetch 1: 3 buffers of 10 bytes; then residents from the last block down
    assert plan_residency(sizes, gpu_bytes=30, prefetch_blocks=1).resident == ()
    assert plan_residency(sizes, gpu_bytes=49, prefetch_blocks=1).resident == (5,)
    assert plan_residency(sizes, gpu_bytes=50, prefetch_blocks=1).resident == (4, 5)
    plan = plan_residency(sizes + [10], gpu_bytes=60, prefetch_blocks=1)
    assert plan.resident == (4, 5, 6) and plan.streamed == (0, 1, 2, 3)
    assert plan.device_bytes == 60
    # everything fits: no buffers at all
    plan = plan_residency(sizes, gpu_bytes=60, prefetch_blocks=1)
    assert plan.resident == tuple(range(6)) and plan.buffer_bytes == 0


def test_buffers_are_counted_at_the_largest_streamed_block():
    sizes = [40] + [10] * 7  # 110 bytes: all resident does not fit 100
    plan = plan_residency(sizes, gpu_bytes=100, prefetch_blocks=0)  # 2 x 40 + residents
    assert plan.resident == (6, 7) and plan.buffer_bytes == 80
    # streaming fewer blocks than the depth needs fewer buffers
    plan = plan_residency([10, 10, 10], gpu_bytes=10 + 10 + 10, prefetch_blocks=3)
    assert plan.resident == (0, 1, 2)


def test_the_longest_fitting_suffix_wins_even_past_a_block_that_does_not_fit_alone():
    # streaming block 2 needs 2 x 100 bytes of buffers; keeping it resident needs 2 x 1
    sizes = [5, 5, 5, 100, 1]  # all resident: 116; blocks 3-4 resident + 2 x 5: 111
    plan = plan_residency(sizes, gpu_bytes=112, prefetch_blocks=0)
    assert plan.resident == (3, 4) and plan.buffer_bytes == 10 and plan.device_bytes == 111
    assert plan_residency(sizes, gpu_bytes=200, prefetch_blocks=0).resident == tuple(range(5))
    with pytest.raises(ValueError, match="at least 111"):  # block 4 alone: 1 + 2 x 100
        plan_residency(sizes, gpu_bytes=110, prefetch_blocks=0)


def test_a_budget_below_the_buffers_is_refused():
    with pytest.raises(ValueError, match=r"gpu_bytes=29 cannot hold.*"
                                         r"at least 30"):
        plan_residency([10] * 6, gpu_bytes=29, prefetch_blocks=1)


@pytest.mark.parametrize("kw,exc", [({"prefetch_blocks": -1}, ValueError),
                                    ({"prefetch_blocks": 1.5}, TypeError),
                                    ({"gpu_bytes": -5}, ValueError)])
def test_bad_arguments(kw, exc):
    args = {"gpu_bytes": 100, "prefetch_blocks": 1} | kw
    with pytest.raises(exc):
        plan_residency([10, 10], **args)


def test_the_last_streamed_blocks_are_kept_into_the_backward():
    """Note [kept into backward]: the last buffer_blocks (prefetch + 2) streamed blocks, never
    a resident one, never more than the buffers."""
    plan = plan_residency([10] * 6, gpu_bytes=None, prefetch_blocks=1)
    assert plan.kept == (3, 4, 5)
    plan = plan_residency([10] * 6, gpu_bytes=None, prefetch_blocks=0)
    assert plan.kept == (4, 5)
    plan = plan_residency([10] * 6, gpu_bytes=50, prefetch_blocks=1)  # 4 and 5 resident
    assert plan.resident == (4, 5) and plan.kept == (1, 2, 3)
    plan = plan_residency([10] * 2, gpu_bytes=None, prefetch_blocks=3)  # fewer than the depth
    assert plan.kept == (0, 1) and plan.buffer_blocks == 2
    assert plan_residency([10] * 3, gpu_bytes=30, prefetch_blocks=1).kept == ()  # all resident
