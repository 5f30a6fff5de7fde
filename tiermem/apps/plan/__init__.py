"""``tiermem plan``: what must go where (GPU / pinned host RAM / NVMe), and does it fit.

Like DeepSpeed's ``estimate_zero*_model_states_mem_needs``, but for all three tiers and with
activations: given a model (size or shape), the batch and the machine's capacities, it places
every part of the training state with tiermem's actual layout and says whether the run fits.
``plan(...)`` is the Python API, ``main(argv)`` the command (exit code 0 fits, 1 does not fit,
2 bad usage). Inputs take any byte unit (``141GB``, ``128GiB``); every size the plan prints is in
GiB (2^30 bytes), so a 128GiB host shows as 128.0 GiB and a 141 GB H200 as 131.3 GiB.

What is where (each module's docstring has the details; every name below is importable from
``tiermem.apps.plan``):

- :mod:`~tiermem.shapes`: :class:`ModelShape`, the ``--model-size`` :data:`PRESETS`,
  the units :data:`GB` and :data:`GiB`;
- :mod:`~tiermem.rates`: the machine, one model of its rates for the planner, the tuner
  and ``examples/train_large.py`` (:class:`MachineRates`, in bytes/s, params/s, FLOP/s and
  seconds; given, the H200 machine's by default, or measured) and its capacities
  (:data:`H200_GPU_BYTES`, ...);
- :mod:`~tiermem.apps.plan.memory`: the memory model (its table of parts, bytes and places), the
  activation formulas (Note [block activations, measured]) and HybridAdam's pinned buffers;
- :mod:`~tiermem.apps.plan.timing`: the time per optimizer step (:func:`step_time`,
  :class:`StepTime`, Note [optimizer tail]);
- :mod:`~tiermem.apps.plan.result`: :class:`Plan` and its table, the notes a plan carries;
- :mod:`~tiermem.apps.plan.placement`: :func:`plan` (the placement and the verdict) and
  :func:`breadth_first_note`;
- :mod:`~tiermem.apps.plan.streaming`: weight streaming in a placement (:class:`StreamPlan`: the
  resident blocks, the buffers, the weights' home and what they move; Note [streaming plan]);
- :mod:`~tiermem.apps.plan.rollback`: the command's refusal of a ``--rollback-bytes`` budget
  that alone keeps the plan from fitting (Note [rollback refusal]);
- :mod:`~tiermem.apps.plan.cli`: the ``tiermem plan`` command (:func:`main`).
"""

from tiermem.apps.plan.cli import blocks_or_auto, build_parser, main
from tiermem.apps.plan.memory import (PARAM_DTYPES, activation_bytes_per_block, head_bytes,
                                 host_buffer_bytes, moe_activation_bytes_per_block)
from tiermem.apps.plan.placement import breadth_first_note, plan
from tiermem.rates import (H200_GPU_BYTES, H200_GPU_FLOPS, H200_GPU_FLOPS_CHECKPOINTED,
                                H200_HOST_BYTES, H200_NVME_BYTES, REFERENCE_CHECKPOINTED_S,
                                REFERENCE_FWD_BWD_S, REFERENCE_TOKENS, MachineRates)
from tiermem.apps.plan.result import Item, Plan
from tiermem.shapes import GB, PRESETS, GiB, ModelShape
from tiermem.apps.plan.streaming import StreamPlan
from tiermem.apps.plan.timing import RESOURCE_NAMES, RESOURCES, StepTime, step_time, step_time_lines

__all__ = ["GB", "GiB", "H200_GPU_BYTES", "H200_GPU_FLOPS", "H200_GPU_FLOPS_CHECKPOINTED",
           "H200_HOST_BYTES", "H200_NVME_BYTES", "Item", "MachineRates", "ModelShape",
           "PARAM_DTYPES", "PRESETS", "Plan", "REFERENCE_CHECKPOINTED_S", "REFERENCE_FWD_BWD_S",
           "REFERENCE_TOKENS", "RESOURCES", "RESOURCE_NAMES", "StepTime", "StreamPlan",
           "activation_bytes_per_block", "blocks_or_auto", "breadth_first_note", "build_parser",
           "head_bytes", "host_buffer_bytes", "main", "moe_activation_bytes_per_block", "plan",
           "step_time", "step_time_lines"]
