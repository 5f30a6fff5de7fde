"""The parity column of the benchmarks: does a setup's training equal the baseline's?

Every timing row of ``tiermem bench activations`` and ``tiermem bench optim`` is printed with
a verdict on its losses, so a fast but wrong setup cannot be reported as fast. The baseline
runs twice in the same process; the largest difference between those two runs at any step is
the noise of the default kernels (bf16 noise on CUDA is discrete and Adam's first update
amplifies it, see Note [training parity] in tests/test_cuda_training_parity.py). A setup
equals the baseline when each of its losses is within ``NOISE_MULTIPLE`` x that noise (plus
``LOSS_FLOOR`` relative) of the first baseline run's.
"""

from __future__ import annotations

from collections.abc import Sequence

NOISE_MULTIPLE = 4.0
LOSS_FLOOR = 1e-6


def noise_of(first: Sequence[float], second: Sequence[float]) -> float:
    """The largest difference between two baseline runs' losses at any step.

    Raises:
        ValueError: the runs have different lengths.
    """
    if len(first) != len(second):
        raise ValueError(f"noise_of: runs of {len(first)} and {len(second)} losses")
    return max((abs(a - b) for a, b in zip(first, second)), default=0.0)


def verdict(losses: Sequence[float], baseline: Sequence[float], noise: float,
            trade: str | None = None) -> str:
    """``"exact"``, ``"equal (d=...)"`` (within the noise bound) or ``"WRONG (d=...)"``.

    ``d`` is the largest loss difference from the baseline at any step. ``trade`` names a
    documented precision trade (e.g. ``"bf16 moments"``): such a setup is reported as
    ``"differs: <trade> (d=...)"`` instead of wrong when it is outside the noise bound.

    Raises:
        ValueError: the runs have different lengths.
    """
    if len(losses) != len(baseline):
        raise ValueError(f"verdict: {len(losses)} losses against {len(baseline)}")
    diffs = [abs(a - b) for a, b in zip(losses, baseline)]
    worst = max(diffs, default=0.0)
    if worst == 0.0:
        return "exact"
    ok = all(d <= NOISE_MULTIPLE * noise + LOSS_FLOOR * abs(b) for d, b in zip(diffs, baseline))
    if ok:
        return f"equal (d={worst:.1e})"
    if trade:
        return f"differs: {trade} (d={worst:.1e})"
    return f"WRONG (d={worst:.1e})"


def worst_verdict(verdicts: Sequence[str]) -> str:
    """A setup's parity over its runs: the first ``WRONG`` one, else the last run's."""
    return next((v for v in verdicts if v.startswith("WRONG")), verdicts[-1])


class BaselineParity:
    """The parity column of a bench whose setups run in order: the ``baseline`` setup's runs
    are the reference (its verdict ``"baseline"``), the ``again`` setup (the baseline once
    more) sets the noise, every baseline-like run against the first, and every setup after
    it is judged against the first baseline run within that noise (:func:`verdict`, the
    worst of its runs by :func:`worst_verdict`)."""

    def __init__(self, baseline: str, again: str) -> None:
        self.baseline, self.again = baseline, again
        self.noise = 0.0
        self._runs: list[Sequence[float]] = []

    def of(self, setup: str, runs: Sequence[Sequence[float]]) -> str:
        """The verdict of ``setup`` from the losses of its ``runs``.

        Raises:
            ValueError: a setup other than the baseline comes before the baseline's runs, or
                a run's length is not the baseline's.
        """
        if setup == self.baseline:
            self._runs = list(runs)
            return "baseline"
        if not self._runs:
            raise ValueError(f"parity of {setup!r} before the baseline {self.baseline!r} ran: "
                             f"run the baseline first")
        if setup == self.again:
            self.noise = max(noise_of(self._runs[0], r) for r in [*self._runs[1:], *runs])
        return worst_verdict([verdict(r, self._runs[0], self.noise) for r in runs])


def report_wrong(labels: Sequence[str], stream, baseline: str = "without offload") -> int:
    """Exit status of a benchmark: 1 (and a line on ``stream``) when the setups ``labels``
    did not train as ``baseline``, else 0."""
    if not labels:
        return 0
    print(f"error: these setups did not train as {baseline}: {', '.join(labels)}", file=stream)
    return 1
