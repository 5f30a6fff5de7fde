"""The policy tuner (``tiermem tune``): time a grid of offload settings under budgets, predict each
from a cost model.

``tune(factory, grid, steps=3, budgets=...)`` builds each setting's training step with
``factory(setting)``, runs a few steps, and measures step time, peak bytes per tier and stall
time in ``TierStore.get``; it marks the fastest setting that fits the budgets and prints a table
with the :class:`CostModel`'s prediction beside each measurement (and bytes per link, peaks per
tier and the trial's own counters). With ``telemetry_dir`` it records each setting's last timed
step and writes a Chrome trace, a side-by-side memory timeline PNG and the results as JSON.
``tiermem tune`` runs it on a GPT (:mod:`tiermem.models.gpt`; small by default, the reference
GPT with ``--layers 24 --d-model 2048 ...``) with activation offload and HybridAdam, over prefetch
depth, offloaded layers, optimizer offload fraction, state tier, store policy, the trace
policy's lookahead and the activation store's gpu budget (``--act-gpu-budget``: below
``prefetch depth + 1`` blocks' worth of activations, prefetches must evict, which is where the
``lru`` and ``trace`` policies differ).

Cost model: each link moves its bytes at its bandwidth (H2D, D2H, NVMe read, NVMe write; the two
NVMe directions share the disk), the CPU Adam steps its parameters at its rate, and compute takes
``compute_s``. Serial prediction: the sum of all; overlapped (``overlap=True``): the largest of
compute, H2D, D2H, NVMe and CPU Adam (perfect overlap; a lower bound). When ``compute_s`` is not
given, :func:`tune` takes it from the setting the model says moves least: its measured step time
minus its predicted offload time (the compute is the same in every setting).

How sure a prediction is: :meth:`CostModel.measure` probes every rate ``probes`` times (3 by
default) and keeps the median, with the slowest and fastest probe in ``CostModel.ranges``; each
prediction then has a range (:meth:`CostModel.predict_range_s`: every rate at its slowest probe,
then at its fastest), printed beside it. A setting whose measured time is more than twice the
prediction, or less than half of it, is reported (a WARNING on the ``tiermem`` logger and a line
under the table): the model does not describe it, so the measurement is what counts.

The rates are the planner's :class:`tiermem.rates.MachineRates` (one model of the machine, measured
here by :meth:`CostModel.measure`). Units: bandwidths in bytes/s, CPU Adam in parameters/s,
times in seconds, sizes in bytes (the printed cost model line says GB/s and G params/s).

Modules: :mod:`~tiermem.apps.tune.cost` (the cost model), :mod:`~tiermem.apps.tune.results` (trials,
results, the grid), :mod:`~tiermem.apps.tune.runner` (:func:`tune`, the measured runs),
:mod:`~tiermem.apps.tune.report` (table and telemetry files), :mod:`~tiermem.apps.tune.workload`
(the GPT
training steps of the command) and :mod:`~tiermem.apps.tune.cli` (``tiermem tune``).
"""

from tiermem.apps.tune.cli import demo_grid, main
from tiermem.apps.tune.cost import DISAGREE_FACTOR, LINKS, RATES, CostModel, link_bytes
from tiermem.apps.tune.report import format_table, write_telemetry
from tiermem.apps.tune.results import Result, Trial, expand_grid, setting_labels
from tiermem.apps.tune.runner import tune
from tiermem.apps.tune.workload import act_gpu_bytes, gpt_factory

__all__ = ["DISAGREE_FACTOR", "LINKS", "RATES", "CostModel", "Result", "Trial", "act_gpu_bytes",
           "demo_grid", "expand_grid", "format_table", "gpt_factory", "link_bytes", "main",
           "setting_labels", "tune", "write_telemetry"]
