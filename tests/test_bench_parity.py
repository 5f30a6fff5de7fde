"""The parity column that ``tiermem bench activations`` and ``tiermem bench lora`` share
(:class:`tiermem.apps.bench.parity.BaselineParity`): the decision for each setup, in the order
the setups run."""

from __future__ import annotations

import pytest

from tiermem.apps.bench.parity import BaselineParity


def test_each_setup_is_judged_against_the_first_baseline_run_within_the_noise():
    p = BaselineParity("base", "again")
    assert p.of("base", [[2.0, 1.5, 1.0], [2.0, 1.5, 1.0 + 1e-3]]) == "baseline"
    assert p.noise == 0.0  # set by the "again" setup, not by the baseline alone
    assert p.of("again", [[2.0, 1.5 + 2e-3, 1.0]]) == "equal (d=2.0e-03)"
    assert p.noise == pytest.approx(2e-3)  # the largest of every baseline-like run's
    assert p.of("exact", [[2.0, 1.5, 1.0], [2.0, 1.5, 1.0]]) == "exact"
    assert p.of("near", [[2.0, 1.5, 1.0 + 7e-3]]) == "equal (d=7.0e-03)"  # within 4 x noise
    # the worst run decides: one run outside 4 x noise makes the setup WRONG
    assert p.of("far", [[2.0, 1.5, 1.0], [2.0, 1.5, 1.0 + 9e-3]]) == "WRONG (d=9.0e-03)"
    assert p.of("far", [[2.0, 1.5, 1.0 + 9e-3], [2.0, 1.5, 1.0]]) == "WRONG (d=9.0e-03)"


def test_without_the_again_setup_any_difference_is_wrong():
    p = BaselineParity("base", "again")
    p.of("base", [[2.0, 1.0]])
    assert p.of("setup", [[2.0, 1.0 + 1e-4]]) == "WRONG (d=1.0e-04)"


def test_a_setup_before_the_baseline_is_refused():
    with pytest.raises(ValueError, match=r"parity of 'x' before the baseline 'base' ran"):
        BaselineParity("base", "again").of("x", [[1.0]])
