"""Choosing the offloaded blocks from measured compute and transfer (tiermem.schedule.layers)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiermem.schedule.layers import (BlockCosts, choose_layers, copy_bandwidths, disk_bandwidths,
                                     kept_budget_bytes, simulate)

import torch


def _uniform(n: int, fwd: float, nbytes: int) -> BlockCosts:
    return BlockCosts((fwd,) * n, (2 * fwd,) * n, (nbytes,) * n)


def test_cheap_copies_offload_every_block_but_the_last():
    # the last block's reload is needed the moment backward starts: it can never hide
    costs = _uniform(6, 1.0, 10)
    assert choose_layers(costs, 1e6, 1e6) == frozenset(range(5))
    assert simulate(costs, range(6), 1e6, 1e6).stall_s == pytest.approx(10 / 1e6)


def test_hand_timeline():
    # 4 blocks, fwd 1 s, bwd 2 s, 3 s per copy (3 bytes at 1 byte/s); offload block 0 only:
    # D2H 1..4 (forward ends at 4: on time); backward 4..12, block 0 runs from 10; its reload
    # is issued at 4 (it is the last offloaded block) and lands at 7: no stall
    costs = _uniform(4, 1.0, 3)
    t = simulate(costs, [0], 1.0, 1.0)
    assert (t.forward_s, t.late_s, t.stall_s, t.kept_bytes) == (4.0, 0.0, 0.0, 9)
    # blocks 0 and 1: D2H 1..4 and 4..7 -> 3 s late; backward starts at 7
    t = simulate(costs, [0, 1], 1.0, 1.0)
    assert t.late_s == 3.0
    # block 1's reload (issued at 7) lands at 10, backward reaches block 1 at 7 + 4 = 11;
    # block 0's is issued when backward enters block 1 (11), lands at 14, needed at 13: 1 s stall
    assert t.stall_s == 1.0
    assert not t.hidden
    assert choose_layers(costs, 1.0, 1.0) == frozenset({0})


def test_uniform_stack_spaces_the_offloaded_blocks():
    # copies take 3 forwards: the first starts when block 0 ends (1 s), so forward (12 s)
    # finishes 3 of them on time; backward needs offloaded blocks 2 blocks (4 s >= 3 s) apart
    costs = _uniform(12, 1.0, 3)
    chosen = choose_layers(costs, 1.0, 1.0)
    assert simulate(costs, chosen, 1.0, 1.0).hidden
    assert len(chosen) == 3 == _best_hidden(costs, 1.0, 1.0, 1) // 3
    order = sorted(chosen)
    assert all(b - a >= 2 for a, b in zip(order, order[1:]))


def _best_hidden(costs, d2h, h2d, depth):
    n = len(costs.fwd_s)
    best = 0
    for r in range(n, 0, -1):
        for subset in itertools.combinations(range(n), r):
            if simulate(costs, subset, d2h, h2d, depth).hidden:
                best = max(best, sum(costs.nbytes[i] for i in subset))
        if best:
            return best
    return best


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 7), fwd=st.floats(0.5, 2.0), nbytes=st.integers(1, 8),
       depth=st.integers(1, 3))
def test_greedy_is_hidden_maximal_and_optimal_on_uniform_stacks(n, fwd, nbytes, depth):
    costs = _uniform(n, fwd, nbytes)
    chosen = choose_layers(costs, 1.0, 1.0, depth)
    assert simulate(costs, chosen, 1.0, 1.0, depth).hidden
    for i in set(range(n)) - chosen:  # maximal: no block can be added without a stall
        assert not simulate(costs, chosen | {i}, 1.0, 1.0, depth).hidden
    assert sum(costs.nbytes[i] for i in chosen) == _best_hidden(costs, 1.0, 1.0, depth)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 8), depth=st.integers(1, 3))
def test_any_stack_choice_is_hidden_and_maximal(data, n, depth):
    fwd = data.draw(st.lists(st.floats(0.0, 3.0), min_size=n, max_size=n))
    nbytes = data.draw(st.lists(st.integers(0, 10), min_size=n, max_size=n))
    costs = BlockCosts(tuple(fwd), tuple(2 * f for f in fwd), tuple(nbytes))
    chosen = choose_layers(costs, 1.5, 2.0, depth)
    assert simulate(costs, chosen, 1.5, 2.0, depth).hidden
    for i in set(range(n)) - chosen:
        if nbytes[i]:
            assert not simulate(costs, chosen | {i}, 1.5, 2.0, depth).hidden


def test_max_kept_bytes_offloads_more_least_stall_first():
    costs = _uniform(12, 1.0, 3)
    hidden = choose_layers(costs, 1.0, 1.0)
    kept = simulate(costs, hidden, 1.0, 1.0).kept_bytes
    tight = choose_layers(costs, 1.0, 1.0, max_kept_bytes=kept - 6)
    assert hidden < tight and len(tight) == len(hidden) + 2
    assert simulate(costs, tight, 1.0, 1.0).kept_bytes <= kept - 6
    assert choose_layers(costs, 1.0, 1.0, max_kept_bytes=0) == frozenset(range(12))
    assert choose_layers(costs, 1.0, 1.0, max_kept_bytes=10 ** 9) == hidden


def test_without_host_times_nothing_changes():
    costs = _uniform(8, 1.0, 3)
    zero = BlockCosts(costs.fwd_s, costs.bwd_s, costs.nbytes, host_s=(0.0,) * 8,
                      offload_host_s=(0.0,) * 8)
    for layers in ([], [0], [0, 3, 6], range(8)):
        assert simulate(zero, layers, 1.0, 1.0) == simulate(costs, layers, 1.0, 1.0)
    assert choose_layers(zero, 1.0, 1.0) == choose_layers(costs, 1.0, 1.0)


def test_host_work_of_an_offload_can_stall_the_forward():
    """4 blocks of 1 s on the device, 0.1 s each to issue, 1.5 s more to offload one; copies
    free. Block 0 offloaded: the host is done issuing it at 1.6 s, so the device ends it there,
    0.6 s late. Block 1 alone: the host has it issued by 1.7 s, the device ends it at 2 s:
    hidden. Blocks 1 and 2: the host is done with block 2 at 3.3 s, the device would end it at
    3 s: 0.3 s late. So block 1 alone is chosen (block 3, the last, never is)."""
    costs = BlockCosts((1.0,) * 4, (2.0,) * 4, (1,) * 4, host_s=(0.1,) * 4,
                       offload_host_s=(1.5,) * 4)
    t = simulate(costs, [0], 1e9, 1e9)
    assert t.host_stall_s == pytest.approx(0.6) and t.forward_s == pytest.approx(4.6)
    assert not t.hidden
    assert simulate(costs, [1], 1e9, 1e9).hidden
    assert simulate(costs, [1, 2], 1e9, 1e9).host_stall_s == pytest.approx(0.3)
    assert choose_layers(costs, 1e9, 1e9) == frozenset({1})
    assert choose_layers(BlockCosts(costs.fwd_s, costs.bwd_s, costs.nbytes), 1e9, 1e9) == \
        frozenset({0, 1, 2})  # without the host clock every block but the last
    # a host-bound stack (issuing takes longer than computing): any offload delays forward
    slow = BlockCosts((1.0,) * 4, (2.0,) * 4, (1,) * 4, host_s=(1.5,) * 4,
                      offload_host_s=(0.1,) * 4)
    assert simulate(slow, [2], 1e9, 1e9).host_stall_s == pytest.approx(0.1)
    assert choose_layers(slow, 1e9, 1e9) == frozenset()
    with pytest.raises(ValueError, match=r"host_s must be empty or have one entry per block"):
        BlockCosts((1.0,), (1.0,), (1,), host_s=(0.1, 0.2))
    with pytest.raises(ValueError, match=r"BlockCosts.offload_host_s\[0\]=-1.0 must be"):
        BlockCosts((1.0,), (1.0,), (1,), offload_host_s=(-1.0,))


def test_auto_default_budget_counts_only_the_kept_blocks():
    """layers="auto" on CUDA (no max_kept_bytes): the timed forward offloaded blocks 0-6 of 8
    (100 MB each) and peaked at 900 MB of 1000 MB; the budget is what stayed (block 7) plus 80%
    of the 100 MB left: 180 MB, so with copies that never hide 7 blocks must go (kept 100 MB).
    Counting the offloaded blocks' 700 MB as well (room the device does not have) would keep
    every block."""
    mb = 10 ** 6
    nbytes = (100 * mb,) * 8
    budget = kept_budget_bytes(nbytes, frozenset(range(7)), 1000 * mb, 900 * mb, 0.8)
    assert budget == 180 * mb
    costs = BlockCosts((1e-3,) * 8, (2e-3,) * 8, nbytes)
    layers = choose_layers(costs, 1.0, 1.0, 1, budget)  # 1 byte/s: nothing hides
    assert len(layers) == 7 and simulate(costs, layers, 1.0, 1.0).kept_bytes == 100 * mb
    assert choose_layers(costs, 1.0, 1.0, 1, 880 * mb) == frozenset()  # what the slip chose
    # a peak over the total leaves no room; the fraction scales the room only
    assert kept_budget_bytes(nbytes, {0}, 500 * mb, 900 * mb) == 700 * mb
    assert kept_budget_bytes(nbytes, set(), 1000 * mb, 0, 0.5) == 1300 * mb


@pytest.mark.parametrize("kwargs, match", [
    (dict(room_fraction=1.5), r"room_fraction=1.5 must be in \[0, 1\]"),
    (dict(peak_bytes=-1), r"byte counts must be >= 0"),
    (dict(offloaded={3}), r"offloaded=\[3\] must be block indices in \[0, 2\)"),
])
def test_kept_budget_bad_input(kwargs, match):
    args = dict(nbytes=(1, 2), offloaded={0}, total_bytes=10, peak_bytes=5) | kwargs
    with pytest.raises(ValueError, match=match):
        kept_budget_bytes(**args)


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match=r"one entry per block"):
        BlockCosts((1.0,), (1.0, 2.0), (1,))
    with pytest.raises(ValueError, match=r"BlockCosts.fwd_s\[0\]=-1.0 must be"):
        BlockCosts((-1.0,), (1.0,), (1,))
    costs = _uniform(3, 1.0, 1)
    with pytest.raises(ValueError, match=r"bandwidths must be > 0"):
        simulate(costs, [0], 0.0, 1.0)
    with pytest.raises(ValueError, match=r"prefetch_depth=0 must be >= 1"):
        simulate(costs, [0], 1.0, 1.0, prefetch_depth=0)
    with pytest.raises(ValueError, match=r"layers \[5\] must be block indices in \[0, 3\)"):
        simulate(costs, [5], 1.0, 1.0)
    with pytest.raises(ValueError, match=r"max_kept_bytes=-1 must be >= 0"):
        choose_layers(costs, 1.0, 1.0, max_kept_bytes=-1)


def test_copy_bandwidths_measures_both_directions():
    d2h, h2d = copy_bandwidths(torch.device("cpu"), nbytes=1 << 20, repeat=1)
    assert d2h > 0 and h2d > 0
    with pytest.raises(ValueError, match="nbytes=0"):
        copy_bandwidths(torch.device("cpu"), nbytes=0)


def test_disk_bandwidths_measure_both_directions(tmp_path):
    write, read = disk_bandwidths(str(tmp_path), nbytes=1 << 20, repeat=1)
    assert write > 0 and read > 0
    assert list(tmp_path.iterdir()) == []  # the probe file is gone
    with pytest.raises(ValueError, match="repeat=0"):
        disk_bandwidths(str(tmp_path), repeat=0)
