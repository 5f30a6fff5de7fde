"""``tiermem plan``: what must go where (GPU / pinned host RAM / NVMe), and does it fit.

Like DeepSpeed's ``estimate_zero*_model_states_mem_needs``, but for all three tiers and with
activations: given a model (size or shape), the batch and the machine's capacities, it places
every part of the training state with tiermem's actual layout and says whether the run fits.
``plan(...)`` is the Python API, ``main(argv)`` the command (exit code 0 fits, 1 does not fit,
2 bad usage). Inputs take any byte unit (``141GB``, ``128GiB``); every size the plan prints is in
GiB (2^30 bytes), so a 128GiB host shows as 128.0 GiB and a 141 GB H200 as 131.3 GiB.

Memory model (bytes; N parameters, L blocks, width d, heads h, vocabulary V, sequence s,
micro-batch b, parameter dtype size p (bf16: 2, fp32: 4), activation dtype size a = p, moments
dtype size m (fp32: 4, bf16: 2; HybridAdam's ``moments_dtype``, on the GPU side and the
offloaded side alike), offload fraction f, offloaded layers k, c elements in the largest
offloaded chunk, ``min(chunk_numel, f·N)``). The optimizer state is sized by
:mod:`tiermem.optim.layout`, the functions HybridAdam allocates and counts by
(``layout.gpu_side_state_bytes``; :func:`host_buffer_bytes` calls the others); its pinned
buffers are rounded up to the store's 4 KiB blocks as in the store:

==========================  ==============================================================
part                        bytes and place
==========================  ==============================================================
parameters                  N·p on the GPU
gradients                   N·p on the GPU (``param.grad`` in the model dtype)
GPU-side optimizer state    (1-f)·N·(2·m + 4·[p != 4]): both moments in the moments dtype,
                            plus an fp32 master copy unless the params are fp32 already (they
                            are their own master): ``layout.gpu_side_state_bytes``; 12 B/param
                            for bf16 params with fp32 moments, 8 with bf16 moments
offloaded optimizer state   f·N·(4 + 2·m): fp32 master + moments, in pinned RAM
                            (``state_tier="cpu"``), in spill files (``"nvme"``), or RAM first
                            and the rest in spill files (``"split"``); per param
                            ``4·state_numel(1, moments)``, not counting the store's rounding
                            of each chunk's blob to 4 KiB
staging buffers             ``layout.ring_bytes(c, p)`` ≈ 6·c·p pinned RAM: HybridAdam's
                            2-chunk gradient ring and 4-chunk param-out ring (gradients wait
                            on the GPU until copied)
NVMe read-ahead             ``layout.nvme_staging_bytes(c, moments, lookahead)`` ≈
                            (lookahead+3)·c·(4 + 2·m) pinned RAM (``chunk_state_bytes`` per
                            chunk), with ``state_tier`` ``"nvme"`` and ``"split"``
GPU lane slots              ``layout.lane_slot_bytes(c, moments)`` = 3·4·c·(3 or 2, +1) on the
                            GPU with ``gpu_step_fraction`` > 0: three chunks of fp32 state and
                            fp32 gradients (Note [gpu lane])
activations, one block      A = b·s·d·a·(9 + 2·r) for the pre-LN GPT block with an MLP ratio
                            r (4: 17·b·s·d·a, 34·b·s·d in bf16 = Megatron's sbh·34 with
                            flash attention): block input, LN1 out, QKV (3), attention out,
                            its reshaped copy, residual, LN2 out, FC out (r), GELU out (r).
                            ``eager_attention`` adds the softmax probabilities 2·b·h·s²·a.
                            Measured: Note [block activations, measured].
MoE block                   A = b·s·[d·a·(9 + 2·K) + 2·K·e·a + K·(28 + a)] for
                            ``tiermem.models.moe``'s block, top_k K, expert width e: the
                            9 above, then per token K copies of the expert input and output
                            (d each) and of the hidden layer before and after the GELU (e
                            each), the gates (a each), the top-k indices, the argsort order
                            and the token index (int64: 8 each) and the fp32 router softmax
                            (4); not the number of experts, nor how the tokens spread over
                            them. Measured: Note [block activations, measured].
checkpointing               a block keeps only its input b·s·d·a; one block's A is rebuilt
                            at a time in backward
activation placement        L-k blocks on the GPU; k blocks in the host tier (pinned; or
                            NVMe), of which prefetch_depth+1 blocks are back on the GPU at
                            a time during backward
head and loss               b·s·(2·d·a + V·(2·a + 8)): final-LN in/out, logits, the fp32
                            log-softmax the loss saves, the logits' gradients in backward
GPU reserve                 CUDA context, cuBLAS workspace, allocator fragmentation:
                            ``gpu_reserve_bytes`` (default 1 GiB + 5 % of the GPU)
host reserve                OS, Python, torch, page cache: ``host_reserve_bytes`` (8 GiB)
==========================  ==============================================================

Checked against the reference 1.34B GPT (micro-batch 8 x 2048 tokens, bf16, fp32 masters and
fused AdamW all on the GPU): the model gives 51.5 GiB without the reserve; the H200 measured a
48.6 GiB peak (``docs/results/bench_optim.log``, the GPU-only row at 16384 tokens/step; one run,
docs/benchmarks_archive.md), so the plan errs on the safe side by 6 %.

Automatic placement (``offload_fraction=None``, ``state_tier="auto"``, ``offload_layers=None``):
keep activations on the GPU if possible, and find the smallest offload fraction (in steps of
0.01) with which the GPU fits; put the offloaded state in RAM, else split it (RAM first, the
rest on NVMe: HybridAdam's ``state_tier="split"``). Only when even ``f = 1`` does not fit the
GPU are the activations of all blocks but the last offloaded (to the host tier). When no
placement fits, the plan says which tier overflows, by how much, and whether RAM + NVMe
together could hold the offloaded state at all (with fp32 and with bf16 moments).

Time per step (``plan.step_time``, :func:`step_time`; docs/sizing.md, "Time per step"): from the
placement and the tokens per optimizer step (``batch x seq x grad_accumulation_steps``), the
predicted seconds of GPU forward + backward, PCIe, CPU Adam and NVMe per optimizer step, from
:class:`MachineRates` (defaults: the H200 machine's logs in ``docs/results``), with HybridAdam's
``gpu_step_fraction`` (the GPU lane: its share of the offloaded params crosses PCIe as state
both ways instead of being stepped by the CPU), and the step's two ends: a floor where the
optimizer's resources pipeline per chunk after (part of) the last micro-batch's backward, and a
ceiling where nothing overlaps (Note [optimizer tail]). Predictions, not measurements.

MoE models (``n_experts``, ``top_k``, ``d_expert``): parameters, gradients and optimizer state
count every parameter (the total, ``MoEConfig.num_params()``); the activations depend on
``top_k`` and ``d_expert`` only; the plan also reports the active parameters (those one token
uses, ``MoEConfig.active_params()``: what the compute per token scales with).

Note [optimizer tail]
~~~~~~~~~~~~~~~~~~~~
HybridAdam cannot hide its work behind forward + backward: gradients are shipped to the CPU side
on the last accumulation pass only, so an offloaded chunk can be stepped no earlier than the last
micro-batch's backward, and with ``max_grad_norm`` no earlier than ``step()``'s global norm (no
gradient is copied before the clip: Note [hybrid step] in ``tiermem/optim/hybrid_adam.py``);
the next forward needs the updated params (``param_sync="step"``). So :func:`step_time`
predicts a step as forward + backward followed by an optimizer phase:

- the optimizer phase takes from ``opt_max = max(PCIe, CPU Adam, NVMe)`` (the chunks
  pipelined: one chunk's copy, kernel and disk I/O while the next's run) to ``opt_sum``, their
  sum (counting only the optimizer's traffic: offloaded activations cross during forward and
  backward, next to the GPU's work);
- it can overlap a window of backward: without ``max_grad_norm`` the backward share of one
  micro-batch, ``GPU / grad_accumulation_steps x 4/6`` (6/8 with checkpointing: backward and
  the recomputed forward of the ``6·N·T`` / ``8·N·T`` count); with ``max_grad_norm`` none;
- with ``max_grad_norm`` and ``param_sync="forward"`` the chunks are stepped in forward order
  (Note [stepping order] in tiermem/optim/hybrid_adam.py) and each module of the next forward
  waits only for its own, so the next step's forward runs beside the phase: the forward
  (2/6 of the GPU time, 2/8 with checkpointing) of the first ``breadth_first_blocks`` blocks
  of every micro-batch and of the other blocks of one (Note [breadth-first blocks] in
  tiermem/schedule/micro_batches.py): ``forward_overlap_s``, taken off the phase. This
  assumes the worker stays ahead of that forward and that the CPU kernel runs as fast beside
  it; without ``max_grad_norm`` the chunks go in backward order, the first layers last, and
  nothing is counted;
- floor (``overlapped_s``): ``max(GPU, activation traffic) + max(0, opt_max - window -
  forward_overlap_s)``, and
  never less than the busiest resource's own time (a link or disk that carries offloaded
  activations and optimizer traffic does one after the other); ceiling (``serial_s``): the sum
  of every resource's time, nothing overlapping.

The docs/sizing.md comparison table shows the logged H200 runs against both ends.

Note [block activations, measured]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Both block formulas share their attention part, 9·d·a per token, and so share its known gaps,
which tests/test_plan.py measures exactly (autograd's saved tensors, each storage once, of one
real block forward on the CPU with its fused SDPA kernel): the fused kernels return the attention
output already laid out as (b, s, h, d/h), so the "reshaped copy" is a view and is not saved
(d·a per token fewer), while LayerNorm's mean and rstd (two per LN: fp32 on CUDA, dtype a on
the CPU) and SDPA's fp32 logsumexp (4·h) are saved but not counted. On CUDA the formulas thus
exceed what a block with fused attention saves by d·a - 16 - 4·h bytes per token (4016 for the
reference GPT: bf16, d = 2048, h = 16; 5.8 % of its block), on the safe side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field

import torch

from tiermem.config import parse_bytes
from tiermem.names import (DTYPE_SPELLINGS, MODEL_DTYPES, MOMENTS_DTYPES, OFFLOAD_TIERS,
                           PARAM_SYNCS, STATE_TIERS, check_choice, check_fraction, check_int,
                           check_number, dtype_name)
from tiermem.optim.layout import (GRAD_SLOTS, LANE_SLOTS, NVME_EXTRA_CHUNKS, OUT_SLOTS,
                                  gpu_side_state_bytes, lane_slot_bytes,
                                  nvme_staging_bytes, ring_bytes, state_numel)
from tiermem.optim.partition import auto_chunk_numel

GB = 1000 ** 3
GiB = 1 << 30

H200_GPU_BYTES = 141 * GB
"""Default GPU capacity: one H200 (141 GB)."""
H200_HOST_BYTES = 128 * GiB
"""Default host RAM: the H200 machine's 128 GiB."""
H200_NVME_BYTES = 64 * GiB
"""Default NVMe capacity: the H200 machine's 64 GiB disk."""

PARAM_DTYPES = MODEL_DTYPES + ("float16",)
"""Parameter dtypes the plan sizes (canonical names): the training loops' and float16 (2 bytes,
sized like bfloat16). Any spelling of :data:`tiermem.names.DTYPE_SPELLINGS` is accepted."""


@dataclass(frozen=True)
class ModelShape:
    """A GPT shape (vocab 32000, MLP ratio 4) and the micro-batch its preset uses."""

    n_layers: int
    d_model: int
    n_heads: int
    vocab: int = 32000
    seq_len: int = 2048
    micro_batch: int = 1
    mlp_ratio: int = 4

    def num_params(self) -> int:
        """Parameters of ``tiermem.models.gpt.GPT`` with this shape (untied head)."""
        d, h = self.d_model, self.mlp_ratio * self.d_model
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
        return self.vocab * d * 2 + self.seq_len * d + self.n_layers * block + 2 * d


PRESETS: dict[str, ModelShape] = {
    "1b": ModelShape(24, 2048, 16, micro_batch=8),   # the reference GPT, 1.34B (docs/benchmarks.md)
    "7b": ModelShape(32, 4096, 32),                  # 6.71B
    "13b": ModelShape(40, 5120, 40),                 # 12.92B
    "30b": ModelShape(60, 6656, 52),                 # 32.34B
    "70b": ModelShape(80, 8192, 64),                 # 64.96B
}
"""``--model-size`` presets: GPT shapes of common sizes (sequence 2048)."""


# ------------------------------------------------------------------------- time per step

REFERENCE_TOKENS = 8 * 2048
"""Tokens of the reference forward + backward: the 1.34B GPT (``PRESETS["1b"]``) at
micro-batch 8 x 2048."""
REFERENCE_FWD_BWD_S = 0.2518
"""Seconds of that forward + backward on the H200: ``docs/results/bench_activations.log``,
"no offload: 251.8 ms/step" (bf16, no checkpointing; median of 3 runs' medians, one call)."""
H200_GPU_FLOPS = 6 * PRESETS["1b"].num_params() * REFERENCE_TOKENS / REFERENCE_FWD_BWD_S
"""The H200's effective rate, 6·N·tokens per second of forward + backward, from the reference
run: 6 x 1,343,868,928 x 16,384 / 0.2518 s = 524.7e12 (attention's own FLOPs and every
overhead are folded into it, as they were in that run)."""
REFERENCE_CHECKPOINTED_S = 0.3095
"""Seconds of the reference forward + backward with every block checkpointed on the H200: the
same log, "checkpoint every block: 309.5 ms/step"."""
H200_GPU_FLOPS_CHECKPOINTED = (8 * PRESETS["1b"].num_params() * REFERENCE_TOKENS
                               / REFERENCE_CHECKPOINTED_S)
"""The same with checkpointing, counted as 8·N·tokens (the forward twice): 569.2e12. The
recomputed forward runs faster per FLOP than the first (it saves nothing), so the 6·N rate
scaled by 8/6 would put the reference at 336 ms; the large checkpointed models ran faster still
(20B: 8.80 s where this rate predicts 9.38 s; 13B: 7.17 s against 7.44 s; docs/sizing.md)."""


@dataclass(frozen=True)
class MachineRates:
    """The machine's rates the time per step is predicted from (:func:`step_time`).

    The defaults are the H200 machine's, one run each (logs in ``docs/results``); pass your
    own (``tiermem bench transfer|adam|io|activations`` measure them) to predict another
    machine. Every rate is a positive finite number (``worker_s_per_chunk``, a time, may be 0).

    Attributes:
        gpu_flops: effective forward + backward rate as ``6·N·tokens`` per second (FLOP/s).
        gpu_flops_checkpointed: the same with every block checkpointed, as ``8·N·tokens``.
        pcie_h2d_bytes_per_s, pcie_d2h_bytes_per_s: pinned copies one direction at a time.
        pcie_both_bytes_per_s: both directions at once, the sum of the two.
        cpu_adam_params_per_s: the CPU Adam kernel with fp32 moments (params/s).
        cpu_adam_bf16_moments_params_per_s: the same with bf16 moments.
        nvme_read_bytes_per_s, nvme_write_bytes_per_s: the spill files' read and write rates.
        worker_s_per_chunk: HybridAdam's chunk worker's seconds per offloaded chunk besides the
            Adam kernel (store get and release, copy issue, events, the GPU lane's hand-off):
            one thread does them between kernels, so they add to the CPU Adam time.

    Raises:
        ValueError: a rate that is not positive or not finite (naming the field);
        TypeError: a rate that is not a number.
    """

    gpu_flops: float = H200_GPU_FLOPS
    gpu_flops_checkpointed: float = H200_GPU_FLOPS_CHECKPOINTED
    # bench_transfer.log, "raw GB/s" column (HybridAdam's rings copy with plain pinned copy_):
    pcie_h2d_bytes_per_s: float = 54.56e9   # "H2D (host -> device) 54.56"
    pcie_d2h_bytes_per_s: float = 54.48e9   # "D2H (device -> host) 54.48"
    pcie_both_bytes_per_s: float = 92.52e9  # "both directions at once 92.52"
    # bench_adam.log, 16 threads: "native mixed" (bf16 params and grads, fp32 master and
    # moments: what HybridAdam runs for a bf16 model) 3.830 G params/s; "native mixed, bf16
    # moments" 4.968 G params/s
    cpu_adam_params_per_s: float = 3.830e9
    cpu_adam_bf16_moments_params_per_s: float = 4.968e9
    # bench_io.log, "SpillSpace posix 4 threads" (the store's default io_threads=4 and
    # io_backend): "write 2.08 GB/s, read 1.74 GB/s"
    nvme_read_bytes_per_s: float = 1.74e9
    nvme_write_bytes_per_s: float = 2.08e9
    # large_20b_ram.log (3,593 chunks of 4M): "optimizer step wall 4.516 s" less "CPU Adam
    # (kernel, summed) 2.790 s", per chunk; the archived chunk-size run agrees (f=1 at 16k
    # tokens: 16M chunks instead of 4M, 240 chunks fewer, 103 ms less: 0.43 ms a chunk)
    worker_s_per_chunk: float = (4.516 - 2.790) / 3593

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            time = f.name == "worker_s_per_chunk"  # a time: 0 counts no worker time
            check_number("MachineRates: ", f.name, getattr(self, f.name), low=0,
                         low_open=not time, high=math.inf, high_open=True,
                         fix="a time is a finite number of seconds >= 0" if time else
                         "a rate is a positive finite number per second")


RESOURCES = ("gpu", "pcie", "cpu_adam", "nvme")
"""The resources :func:`step_time` times, in the order it prints them (and breaks ties by)."""
RESOURCE_NAMES = {"gpu": "GPU fwd+bwd", "pcie": "PCIe", "cpu_adam": "CPU Adam", "nvme": "NVMe"}


@dataclass
class StepTime:
    """The predicted time of one optimizer step per resource (seconds), from
    :class:`MachineRates`; a prediction, not a measurement (docs/sizing.md, "Time per step").

    Attributes:
        tokens: tokens per optimizer step (micro-batch x sequence x accumulation steps).
        micro_batch_tokens: tokens per micro-batch (micro-batch x sequence).
        seconds: per resource (:data:`RESOURCES`): ``gpu`` forward + backward of all
            micro-batches; ``pcie`` the CPU-stepped offloaded params' gradients off and updated
            params back, the GPU lane's state both ways, plus offloaded activations;
            ``cpu_adam`` the CPU Adam kernel on the offloaded params the CPU steps; ``nvme``
            the NVMe-resident state (and activations) read and written.
        bound: the resource with the longest time (ties: the first of :data:`RESOURCES`).
        overlapped_s: the floor (seconds): ``fwd_bwd_s + optimizer_tail_s``, forward +
            backward and then what of the optimizer phase the backward cannot hide (Note
            [optimizer tail]); not ``max(seconds)``, which HybridAdam cannot reach.
        serial_s: the ceiling (seconds): ``sum(seconds)``, nothing overlapping.
        tokens_per_s_overlapped, tokens_per_s_serial: ``tokens`` over those (tokens/s).
        fwd_bwd_s: forward + backward of all micro-batches (seconds): the GPU's time, or the
            offloaded activations' traffic (PCIe, NVMe) when that takes longer.
        optimizer_overlapped_s: the optimizer phase with its resources pipelined per chunk
            (seconds): the largest of its PCIe, CPU Adam and NVMe times (without the
            activations' traffic).
        optimizer_serial_s: the same resources one after another (seconds): their sum.
        overlap_window_s: seconds of backward the optimizer phase can overlap: 0 with
            ``max_grad_norm``, else the last micro-batch's backward, ``seconds["gpu"] /
            accumulation steps x 4/6`` (6/8 with checkpointing).
        optimizer_tail_s: what the optimizer adds to forward + backward at the floor
            (seconds): ``max(0, optimizer_overlapped_s - overlap_window_s)``, or more when the
            busiest resource's own time exceeds ``fwd_bwd_s`` by more (offloaded activations
            and optimizer traffic on one link or disk).
        gpu_share_of_floor: ``seconds["gpu"] / overlapped_s``, the fraction of the floor step
            the GPU computes (1.0 when nothing else takes time).
        gpu_bound_tokens: the least tokens per optimizer step from which the GPU's time is at
            least every other resource's, the optimizer's included (0: at any batch; None: at
            none, the activation traffic per token outgrowing the compute per token). The
            floor step still has the optimizer tail after backward there (with
            ``max_grad_norm``: all of ``optimizer_overlapped_s``).
        gpu_bound_grad_accumulation_steps: the least accumulation steps at this micro-batch
            that reach ``gpu_bound_tokens`` (None with it).
        moved: what the times are sized by: ``pcie_d2h_bytes``, ``pcie_h2d_bytes`` (all
            PCIe bytes each way), ``pcie_gpu_lane_bytes`` (of which the GPU lane's state, the
            same each way), ``cpu_adam_params``, ``gpu_lane_params`` (offloaded params the GPU
            lane steps instead), ``offloaded_chunks`` (each costing the chunk worker
            ``rates.worker_s_per_chunk``), ``nvme_read_bytes``, ``nvme_write_bytes``,
            ``gpu_flops`` (6 or 8 x active params x tokens).
        rates: the rates used.
        gpu_step_fraction: HybridAdam's share of the offloaded params the GPU lane steps.
        max_grad_norm: HybridAdam's gradient clipping norm; None: no clipping.
        forward_overlap_s: seconds of the next step's forward that run beside the optimizer
            tail (Note [optimizer tail]): with ``param_sync="forward"`` and ``max_grad_norm``,
            the forward of the first ``breadth_first_blocks`` blocks of every micro-batch and
            of the rest of one; else 0.
        param_sync: HybridAdam's ``param_sync``.
        breadth_first_blocks: blocks run for every micro-batch first (Note [breadth-first
            blocks] in tiermem/schedule/micro_batches.py).
    """

    tokens: int
    micro_batch_tokens: int
    seconds: dict[str, float]
    bound: str
    overlapped_s: float
    serial_s: float
    tokens_per_s_overlapped: float
    tokens_per_s_serial: float
    fwd_bwd_s: float
    optimizer_overlapped_s: float
    optimizer_serial_s: float
    overlap_window_s: float
    optimizer_tail_s: float
    gpu_share_of_floor: float
    gpu_bound_tokens: int | None
    gpu_bound_grad_accumulation_steps: int | None
    moved: dict[str, float]
    rates: MachineRates
    gpu_step_fraction: float = 0.0
    max_grad_norm: float | None = None
    forward_overlap_s: float = 0.0
    param_sync: str = "step"
    breadth_first_blocks: int = 0


_LANE_MEANING = ("it is HybridAdam's share of the offloaded chunks the GPU steps by streaming "
                 "their state through it (0.0: the CPU steps all)")
"""What ``gpu_step_fraction`` is, for its range errors (as HybridAdam words it)."""


def _check_max_grad_norm(who: str, value) -> None:
    """Refuse a ``max_grad_norm`` that is not None or a number > 0, as HybridAdam does.

    Raises:
        TypeError: not a number (a bool included); ValueError: nan or not above 0.
    """
    if value is not None:
        check_number(who, "max_grad_norm", value, low=0.0, low_open=True,
                     fix="HybridAdam's gradient clipping norm, or None for no clipping "
                         "(command line: --max-grad-norm)")


def step_time(*, active_params: int, offloaded_params: int, param_bytes: int,
              moments_dtype="float32", checkpoint: bool = False, micro_batch_tokens: int,
              grad_accumulation_steps: int = 1, nvme_state_bytes: int = 0,
              activation_offload_bytes: int = 0, activation_tier: str = "cpu",
              gpu_step_fraction: float = 0.0, max_grad_norm: float | None = None,
              offloaded_chunks: int = 0, param_sync: str = "step",
              breadth_first_blocks: int = 0, n_layers: int | None = None,
              rates: MachineRates | None = None) -> StepTime:
    """Predict one optimizer step's time per resource (docs/sizing.md, "Time per step").

    With ``T`` tokens per optimizer step (``micro_batch_tokens x grad_accumulation_steps``):

    - GPU: ``6·active_params·T / rates.gpu_flops`` (forward + backward), or with
      ``checkpoint`` ``8·active_params·T / rates.gpu_flops_checkpointed`` (the forward again in
      backward, at its own measured rate);
    - PCIe: each way once per optimizer step, ``c_p·param_bytes`` for the ``c_p`` offloaded
      params the CPU steps (gradients off, updated params back) plus ``l_p·w`` for the ``l_p``
      the GPU lane steps (their state H2D and back D2H; ``w = 4·state_numel(1, moments)``:
      12 B/param with fp32 moments, 8 with bf16; their gradients stay on the GPU and their
      params are not copied), plus ``activation_offload_bytes`` each way per micro-batch; the
      time is the largest of D2H bytes / D2H rate, H2D bytes / H2D rate and both / the rate
      both ways at once (the two directions overlapping as far as the link allows). ``l_p =
      round(gpu_step_fraction·offloaded_params)``, ``c_p = offloaded_params - l_p`` (HybridAdam
      picks whole chunks, Note [gpu lane]: the same share when the chunks are of one size);
    - CPU Adam: ``c_p`` / the kernel's rate for ``moments_dtype``, plus
      ``offloaded_chunks x rates.worker_s_per_chunk`` (the chunk worker's own time per chunk,
      lane chunks included: fewer, larger chunks shorten it);
    - NVMe: ``nvme_state_bytes`` read and written once per optimizer step, one after the other
      on one disk (plus ``activation_offload_bytes`` per micro-batch with
      ``activation_tier="nvme"``).

    The step (Note [optimizer tail]): the floor is forward + backward (the GPU, or the
    offloaded activations' traffic if slower) plus what of the optimizer phase (its PCIe, CPU
    Adam and NVMe, pipelined per chunk: their max) outlasts the backward it overlaps (none
    with ``max_grad_norm``, else the last micro-batch's backward) and, with ``max_grad_norm``
    and ``param_sync="forward"``, the next step's forward that can run beside it
    (``forward_overlap_s``); the ceiling is the sum of all four resources.

    Every term is ``fixed + per_token·T``; the GPU's is ``g·T``, so the GPU's time is the
    largest from ``T* = max(fixed / (g - per_token))`` over the other terms (closed form; no
    such T when a term grows as fast as the GPU's). The GPU-side Adam on the rest of the params,
    the GPU lane's own fused Adam (small next to the lane's PCIe traffic: docs/sizing.md), the
    launch overheads, page faults and the first step's
    allocation are not counted; nor that the CPU kernel and the lane's copies draw on the same
    host memory (docs/sizing.md, "Time per step").

    Args:
        active_params: params one token uses (the compute; the total for a dense model).
        offloaded_params: params whose optimizer state is off the GPU (``round(f·N)``).
        param_bytes: bytes per param and gradient element (bf16: 2).
        moments_dtype: of the offloaded moments: float32 or bfloat16 (any spelling).
        checkpoint: every block checkpointed (recomputed in backward).
        micro_batch_tokens: micro-batch x sequence.
        grad_accumulation_steps: micro-batches per optimizer step.
        nvme_state_bytes: the offloaded state on NVMe (``state_tier`` nvme or split).
        activation_offload_bytes: activations one micro-batch offloads.
        activation_tier: ``"cpu"`` or ``"nvme"``: where they go.
        gpu_step_fraction: HybridAdam's share of the offloaded params the GPU lane steps, in
            [0.0, 1.0] (0: the CPU steps all).
        max_grad_norm: HybridAdam's gradient clipping norm (> 0); None: no clipping. With it
            the optimizer phase overlaps no backward (it waits for the global norm).
        offloaded_chunks: HybridAdam's offloaded chunks (``ceil(offloaded_params /
            chunk_numel)``; :func:`plan` passes them), each costing the worker
            ``rates.worker_s_per_chunk``; 0: not counted.
        param_sync: HybridAdam's, ``"step"`` or ``"forward"`` (Note [forward sync]).
        breadth_first_blocks: blocks run for every micro-batch before the rest of the first
            (Note [breadth-first blocks]), 0 to ``n_layers``.
        n_layers: the model's blocks (needed with ``breadth_first_blocks``).
        rates: :class:`MachineRates`; None: the H200 machine's.

    Raises:
        ValueError, TypeError: a count that is not a positive int (zero allowed for the
            offloaded and NVMe ones), an unknown dtype or tier, ``gpu_step_fraction`` not a
            number in [0.0, 1.0], ``max_grad_norm`` not a number > 0 (or None), ``rates``
            not MachineRates, an unknown ``param_sync``, ``breadth_first_blocks`` above
            ``n_layers`` or given without it.
    """
    who = "step_time: "
    rates = MachineRates() if rates is None else rates
    if not isinstance(rates, MachineRates):
        raise TypeError(f"{who}rates must be a tiermem.plan.MachineRates, got "
                        f"{type(rates).__name__}")
    check_int(who, "active_params", active_params)
    check_int(who, "param_bytes", param_bytes)
    check_int(who, "micro_batch_tokens", micro_batch_tokens)
    check_int(who, "grad_accumulation_steps", grad_accumulation_steps)
    for name, value in (("offloaded_params", offloaded_params),
                        ("nvme_state_bytes", nvme_state_bytes),
                        ("activation_offload_bytes", activation_offload_bytes),
                        ("offloaded_chunks", offloaded_chunks)):
        check_int(who, name, value, low=0)
    moments = dtype_name(who, "moments_dtype", moments_dtype, MOMENTS_DTYPES)
    check_choice(who, "activation_tier", activation_tier, OFFLOAD_TIERS)
    share = check_fraction(who, "gpu_step_fraction", gpu_step_fraction, _LANE_MEANING)
    _check_max_grad_norm(who, max_grad_norm)
    check_choice(who, "param_sync", param_sync, PARAM_SYNCS)
    check_int(who, "breadth_first_blocks", breadth_first_blocks, low=0, unit="blocks")
    if breadth_first_blocks:
        check_int(who, "n_layers", n_layers)
        if breadth_first_blocks > n_layers:
            raise ValueError(f"{who}breadth_first_blocks={breadth_first_blocks} exceeds "
                             f"n_layers={n_layers}; give 0 to {n_layers}")
    r = rates
    tokens = micro_batch_tokens * grad_accumulation_steps
    flops_per_token = (8 if checkpoint else 6) * active_params
    act_per_token = activation_offload_bytes / micro_batch_tokens  # each way
    lane_params = round(share * offloaded_params)  # Note [gpu lane]: stepped by the GPU
    cpu_params = offloaded_params - lane_params
    lane_bytes = lane_params * 4 * state_numel(1, getattr(torch, moments))  # state, each way
    # each way, once per optimizer step: the CPU chunks' gradients off and params back, the
    # lane chunks' state (fp32 master + moments) in and back
    opt_bytes = cpu_params * param_bytes + lane_bytes
    adam_rate = r.cpu_adam_params_per_s if moments == "float32" else \
        r.cpu_adam_bf16_moments_params_per_s
    disk = 1 / r.nvme_read_bytes_per_s + 1 / r.nvme_write_bytes_per_s  # s per byte read + written
    # (fixed seconds, seconds per token) of each term; a resource takes its largest term
    terms = {
        "pcie": [(opt_bytes / r.pcie_d2h_bytes_per_s, act_per_token / r.pcie_d2h_bytes_per_s),
                 (opt_bytes / r.pcie_h2d_bytes_per_s, act_per_token / r.pcie_h2d_bytes_per_s),
                 (2 * opt_bytes / r.pcie_both_bytes_per_s,
                  2 * act_per_token / r.pcie_both_bytes_per_s)],
        "cpu_adam": [(cpu_params / adam_rate + offloaded_chunks * r.worker_s_per_chunk, 0.0)],
        "nvme": [(nvme_state_bytes * disk,
                  act_per_token * disk if activation_tier == "nvme" else 0.0)],
    }
    g = flops_per_token / (r.gpu_flops_checkpointed if checkpoint else r.gpu_flops)
    seconds = {"gpu": g * tokens}
    for name, ts in terms.items():
        seconds[name] = max(fixed + per * tokens for fixed, per in ts)
    bound = max(RESOURCES, key=lambda k: (seconds[k], -RESOURCES.index(k)))
    # Note [optimizer tail]: forward + backward, then the optimizer phase less what of it
    # overlaps the last micro-batch's backward (nothing with max_grad_norm)
    pcie_per_byte = max(1 / r.pcie_d2h_bytes_per_s, 1 / r.pcie_h2d_bytes_per_s,
                        2 / r.pcie_both_bytes_per_s)  # s per byte moved each way
    act_bytes = act_per_token * tokens  # each way, all micro-batches
    fwd_bwd = max(seconds["gpu"], act_bytes * pcie_per_byte,
                  act_bytes * disk if activation_tier == "nvme" else 0.0)
    opt = (opt_bytes * pcie_per_byte, seconds["cpu_adam"], nvme_state_bytes * disk)
    window = 0.0 if max_grad_norm is not None else \
        seconds["gpu"] / grad_accumulation_steps * ((6 / 8) if checkpoint else (4 / 6))
    # Note [optimizer tail]: the next forward beside the tail (chunks stepped in forward order)
    ahead = 0.0
    if param_sync == "forward" and max_grad_norm is not None:
        first = breadth_first_blocks / n_layers if breadth_first_blocks else 0.0
        ahead = seconds["gpu"] * ((2 / 8) if checkpoint else (2 / 6)) * (
            first + (1 - first) / grad_accumulation_steps)
    # at least the busiest resource's own time: a link or disk carrying both activations
    # and optimizer traffic does not do both at once
    tail = max(0.0, max(opt) - window - ahead, seconds[bound] - fwd_bwd)
    overlapped, serial = fwd_bwd + tail, sum(seconds.values())
    need = 0.0  # T*: g·T >= fixed + per·T for every term
    for fixed, per in (t for ts in terms.values() for t in ts):
        if per >= g and (fixed > 0 or per > g):
            need = None
            break
        if fixed > 0:
            need = max(need, fixed / (g - per))
    gpu_bound = None if need is None else math.ceil(need * (1 - 1e-12))
    act_total = activation_offload_bytes * grad_accumulation_steps
    moved = dict(gpu_flops=float(flops_per_token * tokens),
                 pcie_d2h_bytes=float(opt_bytes + act_total),
                 pcie_h2d_bytes=float(opt_bytes + act_total),
                 pcie_gpu_lane_bytes=float(lane_bytes),
                 cpu_adam_params=float(cpu_params),
                 offloaded_chunks=float(offloaded_chunks),
                 gpu_lane_params=float(lane_params),
                 nvme_read_bytes=float(nvme_state_bytes
                                       + (act_total if activation_tier == "nvme" else 0)),
                 nvme_write_bytes=float(nvme_state_bytes
                                        + (act_total if activation_tier == "nvme" else 0)))
    return StepTime(tokens=tokens, micro_batch_tokens=micro_batch_tokens, seconds=seconds,
                    bound=bound, overlapped_s=overlapped, serial_s=serial,
                    tokens_per_s_overlapped=tokens / overlapped,
                    tokens_per_s_serial=tokens / serial, fwd_bwd_s=fwd_bwd,
                    optimizer_overlapped_s=max(opt), optimizer_serial_s=sum(opt),
                    overlap_window_s=window, optimizer_tail_s=tail,
                    gpu_share_of_floor=seconds["gpu"] / overlapped,
                    gpu_bound_tokens=gpu_bound,
                    gpu_bound_grad_accumulation_steps=None if gpu_bound is None else
                    max(1, math.ceil(gpu_bound / micro_batch_tokens)),
                    moved=moved, rates=rates, gpu_step_fraction=share,
                    max_grad_norm=max_grad_norm, forward_overlap_s=ahead,
                    param_sync=param_sync, breadth_first_blocks=breadth_first_blocks)


def step_time_lines(st: StepTime, *, batch: int | None = None, seq: int | None = None,
                    checkpoint: bool = False) -> list[str]:
    """The time per step as printed by :meth:`Plan.table` (and ``examples/train_large.py``):
    each resource's seconds, the optimizer phase and the backward it overlaps, the bound with
    the floor and ceiling (seconds, tokens/s), and from which tokens per step the GPU's time
    exceeds the optimizer's, with the GPU's share of the floor step at this batch.

    Raises:
        Nothing: formatting of a :class:`StepTime` that :func:`step_time` made.
    """
    default = st.rates == MachineRates()
    accum = st.tokens // st.micro_batch_tokens
    shape = f" = {batch} x {seq} x {accum} accumulated" if batch and seq else ""
    m = st.moved
    c = 8 if checkpoint else 6
    what = {
        "gpu": f"{c} x {m['gpu_flops'] / c / st.tokens / 1e9:,.2f}B params x tokens at "
               f"{(st.rates.gpu_flops_checkpointed if checkpoint else st.rates.gpu_flops) / 1e12:,.1f}"
               f" TFLOP/s"
               + (" (checkpointing: the forward twice)" if checkpoint else ""),
        "pcie": f"{m['pcie_d2h_bytes'] / GiB:,.1f} GiB D2H + {m['pcie_h2d_bytes'] / GiB:,.1f} "
                f"GiB H2D" + (f" (of which {m['pcie_gpu_lane_bytes'] / GiB:,.1f} GiB each way: "
                              f"the state of the {m['gpu_lane_params'] / 1e9:,.2f}B params the "
                              f"GPU lane steps, gpu_step_fraction={st.gpu_step_fraction:g})"
                              if m.get("gpu_lane_params") else ""),
        "cpu_adam": f"{m['cpu_adam_params'] / 1e9:,.2f}B params"
                    + (" (the rest of the offloaded: GPU lane)" if m.get("gpu_lane_params")
                       else "")
                    + (f" + {m['offloaded_chunks']:,.0f} chunks x "
                       f"{st.rates.worker_s_per_chunk * 1e3:.2f} ms (the worker's own time)"
                       if m.get("offloaded_chunks") else ""),
        "nvme": f"{m['nvme_read_bytes'] / GiB:,.1f} GiB read + {m['nvme_write_bytes'] / GiB:,.1f}"
                f" GiB written",
    }
    lines = [f"time per optimizer step, predicted from "
             f"{'the H200 machine' if default else 'the given'} rates (docs/sizing.md): "
             f"{st.tokens:,} tokens{shape}"]
    width = max(len(v) for v in RESOURCE_NAMES.values())
    for k in RESOURCES:
        s = st.seconds[k]
        lines.append(f"  {RESOURCE_NAMES[k].ljust(width)}  "
                     f"{(f'{s:.3f} s' if s else '-').rjust(9)}  {what[k] if s else ''}".rstrip())
    gpu = st.seconds["gpu"]
    if st.max_grad_norm is not None:
        window = (f"overlaps no backward (max_grad_norm={st.max_grad_norm:g}: the CPU step waits "
                  f"for the global norm)")
    else:
        window = (f"overlaps up to {st.overlap_window_s:.3f} s of backward (the last "
                  f"micro-batch's, {'6/8' if checkpoint else '4/6'} of its GPU time: gradients "
                  f"are shipped on the last pass only)")
    if st.forward_overlap_s:
        first = (f"the first {st.breadth_first_blocks} blocks of every micro-batch and the rest "
                 f"of one" if st.breadth_first_blocks else "one micro-batch")
        window += (f"; the next forward runs {st.forward_overlap_s:.3f} s beside it "
                   f"(param_sync='forward': {first})")
    if st.optimizer_serial_s:
        lines.append(f"  optimizer phase after backward: {st.optimizer_overlapped_s:.3f} s (PCIe, "
                     f"CPU Adam, NVMe pipelined per chunk) to {st.optimizer_serial_s:.3f} s (one "
                     f"after another); it {window}")
    else:
        lines.append("  optimizer phase after backward: - (no optimizer state offloaded)")
    if st.bound == "gpu":  # then forward + backward is the GPU's (it outlasts the activations')
        bound = RESOURCE_NAMES["gpu"] + (f" + optimizer tail {st.optimizer_tail_s:.3f} s"
                                         if st.optimizer_tail_s else "")
        floor = "floor"
    else:
        bound = RESOURCE_NAMES[st.bound]
        fwd_bwd = "GPU fwd+bwd" if st.fwd_bwd_s == gpu else \
            "fwd+bwd (the offloaded activations' traffic)"
        floor = (f"floor: {fwd_bwd} {st.fwd_bwd_s:.3f} s + optimizer tail "
                 f"{st.optimizer_tail_s:.3f} s")
    lines.append(f"  bound: {bound}; step {st.overlapped_s:.3f} s ({floor}) to "
                 f"{st.serial_s:.3f} s (ceiling: nothing overlapped): "
                 f"{st.tokens_per_s_overlapped:,.0f} to "
                 f"{st.tokens_per_s_serial:,.0f} tokens/s")
    share = (f"at {st.tokens:,} tokens the GPU computes {100 * st.gpu_share_of_floor:.0f} % of "
             f"the floor step")
    if st.gpu_bound_tokens == 0:
        lines.append(f"  the GPU's time exceeds every other resource's at any batch (no optimizer "
                     f"state is offloaded); {share}")
    elif st.gpu_bound_tokens is None:
        lines.append(f"  the GPU's time exceeds the others' at no batch: offloaded activations "
                     f"cross PCIe (or NVMe) faster per token than the GPU computes; {share}")
    else:
        lines.append(f"  the GPU's time exceeds the optimizer's from {st.gpu_bound_tokens:,} "
                     f"tokens per optimizer step (grad_accumulation_steps >= "
                     f"{st.gpu_bound_grad_accumulation_steps} at {st.micro_batch_tokens:,} "
                     f"tokens per micro-batch); {share}")
    return lines


@dataclass
class Item:
    """One row of the plan: bytes of one part of the training state per tier."""

    name: str
    gpu: int = 0
    host: int = 0
    nvme: int = 0
    note: str = ""


@dataclass
class Plan:
    """The placement and the verdict. All sizes in bytes.

    Attributes:
        num_params: all parameters (what weights, gradients and optimizer state are sized by).
        active_params: parameters one token uses (what compute per token scales with): fewer
            than ``num_params`` for an MoE (``top_k`` of ``n_experts`` experts), equal for a
            dense model.
        fits: every tier within its capacity.
        offload_fraction: chosen (or given) fraction of optimizer state off the GPU.
        state_tier: ``"cpu"``, ``"nvme"`` or ``"split"``: where the offloaded state lives.
        offload_layers: blocks whose activations go to the host tier.
        items: the rows (what goes where).
        capacity, used: per tier (``"gpu"``, ``"host"``, ``"nvme"``).
        reasons: why it does not fit (empty when it fits).
        notes: hints (how to configure it, what else would fit).
        inputs: the arguments the plan was made from (canonical spellings).
        step_time: the predicted time per optimizer step of this placement
            (:class:`StepTime`; also when it does not fit, though the table then omits it).
        breadth_first_blocks: blocks run for every micro-batch first (given, or chosen for
            ``"auto"``; Note [breadth-first blocks]).
    """

    num_params: int
    active_params: int
    fits: bool
    offload_fraction: float
    state_tier: str
    offload_layers: int
    checkpoint: bool
    items: list[Item]
    capacity: dict[str, int]
    used: dict[str, int]
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    inputs: dict = field(default_factory=dict)
    step_time: StepTime | None = None
    breadth_first_blocks: int = 0

    def to_dict(self) -> dict:
        """Plain-data form (for ``--json``)."""
        return dataclasses.asdict(self)

    def table(self) -> str:
        """The human-readable plan: a table of parts per tier, totals, verdict and notes."""
        def gb(n: int) -> str:  # one unit everywhere in the output: GiB (2^30 bytes)
            return f"{n / GiB:,.1f} GiB" if n else "-"
        rows = [("part", "GPU", "host RAM", "NVMe", "")]
        rows += [(i.name, gb(i.gpu), gb(i.host), gb(i.nvme), i.note) for i in self.items]
        rows.append(("total", gb(self.used["gpu"]), gb(self.used["host"]), gb(self.used["nvme"]), ""))
        rows.append(("capacity", gb(self.capacity["gpu"]), gb(self.capacity["host"]),
                     gb(self.capacity["nvme"]), ""))
        free = {t: self.capacity[t] - self.used[t] for t in self.capacity}
        rows.append(("free", *(f"{free[t] / GiB:,.1f} GiB" for t in ("gpu", "host", "nvme")), ""))
        width = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = []
        for n, r in enumerate(rows):
            cells = [r[0].ljust(width[0])] + [r[i].rjust(width[i]) for i in (1, 2, 3)]
            lines.append("  ".join(cells) + (f"  {r[4]}" if r[4] else ""))
            if n == 0 or n == len(self.items):
                lines.append("-" * len(lines[-1]))
        verdict = "FITS" if self.fits else "DOES NOT FIT"
        where = f" (state_tier={self.state_tier})" if self.offload_fraction else ""
        head = (f"{self.num_params / 1e9:.2f}B params: {verdict} with optimizer state "
                f"{self.offload_fraction:.0%} off the GPU{where}, "
                f"activations of {self.offload_layers} blocks offloaded"
                f"{', checkpointing' if self.checkpoint else ''}")
        out = [head]
        moe = self.inputs.get("n_experts")
        if moe:
            out.append(f"parameters: {self.num_params / 1e9:.2f}B in total (weights, gradients, "
                       f"optimizer state: all {moe} experts), {self.active_params / 1e9:.2f}B "
                       f"active per token (top-{self.inputs['top_k']}: the compute per token)")
        out += [""] + lines
        if self.fits and self.step_time is not None:
            out += [""] + step_time_lines(self.step_time, batch=self.inputs.get("batch"),
                                          seq=self.inputs.get("seq"), checkpoint=self.checkpoint)
        out += [""] + [f"does not fit: {r}" for r in self.reasons]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out).rstrip() + "\n"


def _short(name: str) -> str:
    """The short spelling the plan prints for a canonical dtype name (``"bfloat16"`` -> ``"bf16"``):
    the shortest of :data:`tiermem.names.DTYPE_SPELLINGS`."""
    return min((s for s, canon in DTYPE_SPELLINGS.items() if canon == name), key=len)


def _largest_chunk(offloaded_numel: int, chunk_numel: int | None) -> int:
    """Elements of HybridAdam's largest offloaded chunk: ``min(chunk_numel, offloaded_numel)``,
    ``chunk_numel`` None meaning :func:`tiermem.optim.partition.auto_chunk_numel` (0: nothing
    offloaded)."""
    if not offloaded_numel:
        return 0
    return min(chunk_numel or auto_chunk_numel(offloaded_numel), offloaded_numel)


def host_buffer_bytes(offloaded_numel: int, chunk_numel: int | None, dtype, moments_dtype,
                      nvme_lookahead_chunks: int, state_tier: str) -> tuple[int, int]:
    """``(pinned rings, NVMe staging)``: the pinned host bytes HybridAdam allocates besides the
    offloaded state for ``offloaded_numel`` elements in one param group, by
    :func:`tiermem.optim.layout.ring_bytes` and :func:`~tiermem.optim.layout.nvme_staging_bytes`
    (staging with ``state_tier`` ``"nvme"`` or ``"split"`` only, else 0).

    Args:
        offloaded_numel: elements whose state is offloaded (0: no buffers).
        chunk_numel: HybridAdam's ``chunk_numel``; None: its default,
            :func:`tiermem.optim.partition.auto_chunk_numel`. The buffers are sized by the
            largest chunk, ``min(chunk_numel, offloaded_numel)``.
        dtype, moments_dtype: ``torch.dtype`` of the params and of the moments.
        nvme_lookahead_chunks: HybridAdam's.
        state_tier: ``"cpu"``, ``"nvme"`` or ``"split"``.

    Raises:
        Nothing: plain arithmetic on checked values.
    """
    if not offloaded_numel:
        return 0, 0
    chunk = _largest_chunk(offloaded_numel, chunk_numel)
    rings = ring_bytes(chunk, dtype.itemsize)
    staging = nvme_staging_bytes(chunk, moments_dtype, nvme_lookahead_chunks) \
        if state_tier in ("nvme", "split") else 0
    return rings, staging


def _moe_shape(n_experts, top_k, d_expert) -> bool:
    """Validate the MoE inputs; True for an MoE, False for a dense model (none given)."""
    given = {"n_experts": n_experts, "top_k": top_k, "d_expert": d_expert}
    if all(v is None for v in given.values()):
        return False
    missing = [name for name, v in given.items() if v is None]
    if missing:
        raise ValueError(f"plan: an MoE needs n_experts, top_k and d_expert; {', '.join(missing)} "
                         f"missing (command line: --experts, --top-k, --d-expert)")
    for name, value in given.items():
        check_int("plan: ", name, value)
    if top_k > n_experts:
        raise ValueError(f"top_k={top_k} exceeds n_experts={n_experts}; route each token to at "
                         f"most n_experts experts")
    return True


def _attention_bytes(*, batch: int, seq: int, d_model: int, n_heads: int, dtype_bytes: int,
                     eager_attention: bool) -> int:
    """Bytes a pre-LN block saves outside its MLP: ``9·b·s·d·a`` (+ the eager softmax)."""
    n = batch * seq * d_model * dtype_bytes * 9
    if eager_attention:
        n += 2 * batch * n_heads * seq * seq * dtype_bytes
    return n


def activation_bytes_per_block(*, batch: int, seq: int, d_model: int, n_heads: int,
                               dtype_bytes: int, mlp_ratio: int = 4,
                               eager_attention: bool = False) -> int:
    """Bytes autograd saves for one pre-LN GPT block (see the module's table).

    ``b·s·d·a·(9 + 2·mlp_ratio)``, plus ``2·b·h·s²·a`` for the softmax of eager attention
    (Note [block activations, measured] says how it compares with what a block saves).
    Arguments: sequences, tokens per sequence, width, heads, bytes per activation element,
    MLP width / d_model, whether attention saves its softmax.

    Raises:
        nothing: plain arithmetic on the given ints (:func:`plan` validates them).
    """
    mlp = batch * seq * d_model * dtype_bytes * 2 * mlp_ratio  # FC out, GELU out
    return _attention_bytes(batch=batch, seq=seq, d_model=d_model, n_heads=n_heads,
                            dtype_bytes=dtype_bytes, eager_attention=eager_attention) + mlp


def moe_activation_bytes_per_block(*, batch: int, seq: int, d_model: int, n_heads: int,
                                   dtype_bytes: int, top_k: int, d_expert: int,
                                   eager_attention: bool = False) -> int:
    """Bytes autograd saves for one block of :mod:`tiermem.models.moe` (see the module's table).

    ``b·s·[d·a·(9 + 2·K) + 2·K·e·a + K·(28 + a)]`` for ``K = top_k``, ``e = d_expert``, plus
    ``2·b·h·s²·a`` for the softmax of eager attention: the dense block's attention part, then
    per token and chosen expert the expert's input and output (``d`` each), its hidden layer
    before and after the GELU (``e`` each), the gate (``a``), the top-k index, the argsort
    order and the token index (int64) and the fp32 router probability. The number of experts
    does not enter: each token runs ``top_k`` of them.
    Measured: Note [block activations, measured].

    Raises:
        nothing: plain arithmetic on the given ints (:func:`plan` validates them).
    """
    tokens, a, k = batch * seq, dtype_bytes, top_k
    experts = tokens * (2 * k * d_model * a + 2 * k * d_expert * a + k * (8 + 8 + 8 + 4 + a))
    return _attention_bytes(batch=batch, seq=seq, d_model=d_model, n_heads=n_heads,
                            dtype_bytes=dtype_bytes, eager_attention=eager_attention) + experts


def head_bytes(*, batch: int, seq: int, d_model: int, vocab: int, dtype_bytes: int) -> int:
    """Bytes of the head and loss: ``b·s·(2·d·a + V·(2·a + 8))`` (see the module's table)."""
    return batch * seq * (2 * d_model * dtype_bytes + vocab * (2 * dtype_bytes + 8))


def plan(num_params=None, *, model=None, n_layers: int | None = None,
         d_model: int | None = None, n_heads: int | None = None, vocab: int = 32000,
         seq: int = 2048, batch: int = 1, mlp_ratio: int = 4, n_experts: int | None = None,
         top_k: int | None = None, d_expert: int | None = None, dtype=None,
         moments_dtype="fp32", gpu_bytes=H200_GPU_BYTES, host_bytes=H200_HOST_BYTES,
         nvme_bytes=H200_NVME_BYTES, offload_fraction: float | None = None,
         state_tier: str = "auto", offload_layers: int | None = None,
         activation_tier: str = "cpu", checkpoint: bool = False, prefetch_depth: int = 1,
         eager_attention: bool = False, gpu_reserve_bytes=None, host_reserve_bytes=8 * GiB,
         chunk_numel: int | None = None, nvme_lookahead_chunks: int = 2,
         grad_accumulation_steps: int = 1, gpu_step_fraction: float = 0.0,
         max_grad_norm: float | None = None, param_sync: str = "step",
         breadth_first_blocks: int | str = 0, rates: MachineRates | None = None) -> Plan:
    """Place a training run's state on GPU / host RAM / NVMe and say whether it fits.

    Args:
        num_params: parameter count (for an MoE: all parameters, every expert's), or an
            ``nn.Module`` (its parameters are counted, its dtype taken, and its ``cfg`` read
            when it is a ``tiermem.models.GPT`` or ``tiermem.models.MoE``); None with an MoE
            shape: counted from the shape (``tiermem.models.MoEConfig.num_params``).
        model: an ``nn.Module`` (alternative to passing it as ``num_params``).
        n_layers, d_model, n_heads: the transformer's shape, for the activation estimate
            (required unless the model is a tiermem GPT; ``n_heads`` only matters with
            ``eager_attention``; default d_model/128).
        vocab: vocabulary size (tokens), for the head and loss.
        seq: tokens per sequence.
        batch: sequences per micro-batch.
        mlp_ratio: MLP width / d_model (dense models).
        n_experts, top_k, d_expert: an MoE block (``tiermem.models.moe``): experts per block,
            experts per token, expert hidden width; all three or none (dense). The
            activations depend on ``top_k`` and ``d_expert``; ``plan.active_params`` is the
            total less the ``n_experts - top_k`` experts per block a token skips.
        dtype: parameter (and activation) dtype: bfloat16 or float32 (float16: 2 bytes), in any
            spelling of :data:`tiermem.names.DTYPE_SPELLINGS` (``"bf16"``, ``"bfloat16"``,
            ``torch.bfloat16``, ...); None: the model's dtype when a model is given, else bf16.
        moments_dtype: dtype of the Adam moments, float32 or bfloat16, in any spelling
            (``"fp32"``, ``"float32"``, ``torch.float32``, ...): HybridAdam's, which stores them
            so on the GPU side and the offloaded side alike (bf16: 4 B/param less on each).
            ``plan.inputs`` keeps both dtypes by their canonical names (``"bfloat16"``).
        gpu_bytes, host_bytes, nvme_bytes: capacities in bytes (ints or strings like
            ``"141GB"``, ``"128GiB"``); defaults: the H200 machine.
        offload_fraction: fraction of the optimizer state off the GPU in [0, 1]; None: the
            smallest that fits.
        state_tier: ``"cpu"``, ``"nvme"``, ``"split"`` (RAM first, the rest on NVMe, like
            HybridAdam's ``state_tier="split"``) or ``"auto"`` (RAM if it fits, else split).
        offload_layers: blocks whose activations are offloaded, in [0, n_layers); None:
            0, or n_layers-1 when the GPU cannot fit otherwise.
        activation_tier: ``"cpu"`` or ``"nvme"``: where offloaded activations go.
        checkpoint: activation checkpointing of every block.
        prefetch_depth: blocks reloaded ahead in backward (offloaded activations).
        eager_attention: the attention saves its softmax (no flash/efficient SDPA kernel).
        gpu_reserve_bytes: GPU bytes kept free for the CUDA context, workspaces and
            fragmentation; None: 1 GiB + 5 % of ``gpu_bytes``.
        host_reserve_bytes: host bytes kept free for the OS, Python and torch.
        chunk_numel, nvme_lookahead_chunks: HybridAdam's, for the pinned staging and NVMe
            read-ahead buffers (``chunk_numel=None``: HybridAdam's default for the offloaded
            elements, see :func:`tiermem.optim.partition.auto_chunk_numel`).
        grad_accumulation_steps: micro-batches per optimizer step: the time per step depends
            on it (``batch x seq x grad_accumulation_steps`` tokens), the memory only with
            ``breadth_first_blocks``.
        gpu_step_fraction: HybridAdam's share of the offloaded chunks the GPU steps (Note [gpu
            lane] in ``tiermem/optim/hybrid_adam.py``), in [0, 1]: only the time per step
            depends on it (that share crosses PCIe as state both ways instead of being stepped
            by the CPU; :func:`step_time`); the lane's device slots are not in the memory.
        max_grad_norm: HybridAdam's gradient clipping norm (a number > 0), or None (no
            clipping): only the time per step depends on it (with it the optimizer phase
            overlaps no backward: Note [optimizer tail]).
        param_sync: HybridAdam's, ``"step"`` or ``"forward"``: only the time per step depends
            on it (Note [optimizer tail]).
        breadth_first_blocks: blocks run for every micro-batch before the rest of the first
            (Note [breadth-first blocks]), 0 to ``n_layers``: each of the other
            ``grad_accumulation_steps - 1`` micro-batches keeps what those blocks saved plus
            its hidden state on the GPU (an item of its own), and with ``param_sync="forward"``
            the step time counts that forward beside the optimizer tail. ``"auto"``: the most
            blocks that still fit, after the fraction and tier are chosen (so with
            ``offload_fraction=None``, usually none).
        rates: :class:`MachineRates` the time per step is predicted from; None: the H200
            machine's.

    Returns:
        a :class:`Plan` (``plan.fits``, ``plan.table()``, ``plan.step_time``).

    Raises:
        ValueError: a missing or non-positive size, an unknown dtype, tier or param_sync,
            ``breadth_first_blocks`` above ``n_layers``, a fraction
            (``offload_fraction``, ``gpu_step_fraction``) outside [0, 1], ``max_grad_norm``
            not above 0 or nan, ``offload_layers`` outside [0, n_layers), an MoE shape given
            in part, ``top_k`` > ``n_experts``, or ``num_params`` not above the parameters of
            the experts a token skips, naming the argument.
        TypeError: ``num_params``/``model`` neither a number nor an ``nn.Module``; a count
            that is not an int, or a fraction or ``max_grad_norm`` that is not a number
            (naming the argument); ``rates`` not a :class:`MachineRates`.
    """
    if model is not None and num_params is not None:
        raise TypeError("plan: pass num_params or model, not both")
    model = model if model is not None else (None if num_params is None or
                                             isinstance(num_params, (int, float)) else num_params)
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"plan: num_params must be a number or an nn.Module, got "
                            f"{type(model).__name__}")
        params = list(model.parameters())
        num_params = sum(p.numel() for p in params)
        if params and dtype is None:
            dtype = params[0].dtype  # the model's own dtype when none is given
        cfg = getattr(model, "cfg", None)
        if cfg is not None:
            n_layers = n_layers or getattr(cfg, "n_layers", None)
            d_model = d_model or getattr(cfg, "d_model", None)
            n_heads = n_heads or getattr(cfg, "n_heads", None)
            vocab = getattr(cfg, "vocab", vocab)
            mlp_ratio = getattr(cfg, "mlp_ratio", mlp_ratio)
            n_experts = n_experts or getattr(cfg, "n_experts", None)
            top_k = top_k or getattr(cfg, "top_k", None)
            d_expert = d_expert or getattr(cfg, "d_expert", None)
    moe = _moe_shape(n_experts, top_k, d_expert)
    if num_params is None and not moe:
        raise ValueError("plan: give the model size: num_params (e.g. 13e9), a model, or an MoE "
                         "shape (n_experts, top_k, d_expert)")
    if num_params is not None and (isinstance(num_params, bool) or not isinstance(
            num_params, (int, float)) or not num_params >= 1 or not math.isfinite(num_params)):
        raise ValueError(f"plan: num_params={num_params!r} must be a positive number")
    if n_layers is None or d_model is None:
        raise ValueError("plan: the activation estimate needs the shape: n_layers and d_model "
                         "(command line: --layers and --d-model, or --model-size)")
    n_layers = check_int("plan: ", "n_layers", n_layers)
    d_model = check_int("plan: ", "d_model", d_model)
    n_heads = check_int("plan: ", "n_heads", n_heads or max(1, d_model // 128))
    for name, value in (("vocab", vocab), ("seq", seq), ("batch", batch),
                        ("mlp_ratio", mlp_ratio), ("prefetch_depth", prefetch_depth),
                        ("grad_accumulation_steps", grad_accumulation_steps)):
        check_int("plan: ", name, value)
    if rates is not None and not isinstance(rates, MachineRates):
        raise TypeError(f"plan: rates must be a tiermem.plan.MachineRates, got "
                        f"{type(rates).__name__}")
    n = active = None if num_params is None else int(num_params)
    if moe:
        from tiermem.models.moe import MoEConfig  # torch is loaded with tiermem already
        # n_heads=1: heads do not change the count (and need not divide d_model here)
        cfg = MoEConfig(n_layers=n_layers, d_model=d_model, n_heads=1, seq_len=seq,
                        vocab=vocab, n_experts=n_experts, top_k=top_k, d_expert=d_expert)
        n = cfg.num_params() if n is None else n
        skipped = cfg.num_params() - cfg.active_params()  # the experts a token does not run
        if n <= skipped:
            raise ValueError(f"plan: num_params={num_params!r} is not above the {skipped:,} "
                             f"parameters of the experts a token skips (n_layers x (n_experts - "
                             f"top_k) experts of d_expert={d_expert}); give the total count, "
                             f"or check n_experts and d_expert")
        active = n - skipped
    if chunk_numel is not None:
        check_int("plan: ", "chunk_numel", chunk_numel)
    check_int("plan: ", "nvme_lookahead_chunks", nvme_lookahead_chunks, low=0)
    # one spelling from here on: the canonical name (inputs, notes) and the torch.dtype (sizes)
    dtype = dtype_name("plan: ", "dtype", "bfloat16" if dtype is None else dtype, PARAM_DTYPES)
    moments_dtype = dtype_name("plan: ", "moments_dtype", moments_dtype, MOMENTS_DTYPES)
    param_dt, moments_dt = getattr(torch, dtype), getattr(torch, moments_dtype)
    p = param_dt.itemsize
    cap = {"gpu": parse_bytes(gpu_bytes, "gpu_bytes"), "host": parse_bytes(host_bytes, "host_bytes"),
           "nvme": parse_bytes(nvme_bytes, "nvme_bytes")}
    if cap["gpu"] == 0:
        raise ValueError("gpu_bytes=0: the plan needs a GPU capacity")
    gpu_reserve = (GiB + cap["gpu"] // 20) if gpu_reserve_bytes is None else \
        parse_bytes(gpu_reserve_bytes, "gpu_reserve_bytes")
    host_reserve = parse_bytes(host_reserve_bytes, "host_reserve_bytes")
    if offload_fraction is not None:
        check_fraction("plan: ", "offload_fraction", offload_fraction,
                       "the optimizer state off the GPU, or None: the least that fits")
    gpu_step_fraction = check_fraction("plan: ", "gpu_step_fraction", gpu_step_fraction,
                                       _LANE_MEANING)
    _check_max_grad_norm("plan: ", max_grad_norm)
    check_choice("plan: ", "param_sync", param_sync, PARAM_SYNCS)
    auto_blocks = breadth_first_blocks == "auto"
    if auto_blocks:
        breadth_first_blocks = 0  # the placement is chosen without them, then the most that fit
    check_int("plan: ", "breadth_first_blocks", breadth_first_blocks, low=0, unit="blocks",
              fix=f"give 0 (depth-first) to {n_layers}, or 'auto'")
    if breadth_first_blocks > n_layers:
        raise ValueError(f"plan: breadth_first_blocks={breadth_first_blocks} exceeds "
                         f"n_layers={n_layers}; give 0 (depth-first) to {n_layers}")
    check_choice("plan: ", "state_tier", state_tier, ("auto",) + STATE_TIERS,
                 "auto: RAM if it fits, else split")
    check_choice("plan: ", "activation_tier", activation_tier, OFFLOAD_TIERS)
    if offload_layers is not None and (isinstance(offload_layers, bool) or not isinstance(
            offload_layers, int) or not 0 <= offload_layers < n_layers):
        raise ValueError(f"offload_layers={offload_layers!r} must be an int in [0, {n_layers}) "
                         f"(the last block's activations stay on the GPU)")

    shape = dict(batch=batch, seq=seq, d_model=d_model, dtype_bytes=p)
    if moe:
        per_block = moe_activation_bytes_per_block(**shape, n_heads=n_heads, top_k=top_k,
                                                   d_expert=d_expert,
                                                   eager_attention=eager_attention)
    else:
        per_block = activation_bytes_per_block(**shape, n_heads=n_heads, mlp_ratio=mlp_ratio,
                                               eager_attention=eager_attention)
    block_input = batch * seq * d_model * p
    kept_per_block = block_input if checkpoint else per_block
    head = head_bytes(**shape, vocab=vocab)
    gpu_state_per_param = gpu_side_state_bytes(1, param_dt, moments_dt)  # 12 or 8 (bf16 params)
    off_state_per_param = 4 * state_numel(1, moments_dt)  # fp32 master + moments: 12 or 8
    inputs = dict(num_params=n, n_layers=n_layers, d_model=d_model, n_heads=n_heads, vocab=vocab,
                  seq=seq, batch=batch, grad_accumulation_steps=grad_accumulation_steps,
                  gpu_step_fraction=gpu_step_fraction, max_grad_norm=max_grad_norm,
                  param_sync=param_sync,
                  breadth_first_blocks="auto" if auto_blocks else breadth_first_blocks,
                  n_experts=n_experts, top_k=top_k, d_expert=d_expert,
                  dtype=dtype, moments_dtype=moments_dtype,
                  checkpoint=checkpoint, activation_tier=activation_tier,
                  prefetch_depth=prefetch_depth, gpu_reserve_bytes=gpu_reserve,
                  host_reserve_bytes=host_reserve)

    def build(f: float, tier: str, k: int, bf: int = breadth_first_blocks) -> Plan:
        off_n = round(f * n)
        gpu_n = n - off_n
        items = [Item("parameters", gpu=n * p, note=_short(dtype)),
                 Item("gradients", gpu=n * p, note=_short(dtype))]
        items.append(Item("optimizer state, GPU side",
                          gpu=gpu_side_state_bytes(gpu_n, param_dt, moments_dt),
                          note=f"{gpu_state_per_param} B/param ("
                               f"{'fp32 master + ' if param_dt != torch.float32 else ''}"
                               f"{_short(moments_dtype)} moments)"))
        state = off_n * off_state_per_param
        state_item = Item("optimizer state, offloaded",
                          host=state if tier == "cpu" else 0, nvme=state if tier == "nvme" else 0,
                          note=f"{off_state_per_param} B/param (fp32 master + "
                               f"{_short(moments_dtype)} moments)" if off_n else "")
        items.append(state_item)
        rings, staging = host_buffer_bytes(off_n, chunk_numel, param_dt, moments_dt,
                                           nvme_lookahead_chunks, tier)
        if rings:
            items.append(Item("pinned staging (grads + params)", host=rings,
                              note=f"{GRAD_SLOTS} + {OUT_SLOTS} chunks"))
        if staging:
            items.append(Item("NVMe read-ahead buffers", host=staging,
                              note=f"{nvme_lookahead_chunks}+{NVME_EXTRA_CHUNKS} chunks"))
        if off_n and gpu_step_fraction > 0:  # Note [gpu lane]: device slots, not the state
            items.append(Item("GPU lane slots",
                              gpu=lane_slot_bytes(_largest_chunk(off_n, chunk_numel), moments_dt),
                              note=f"{LANE_SLOTS} chunks of state + fp32 grads"))
        on_gpu_blocks = n_layers - k
        window = min(k, prefetch_depth + 1)
        act = Item("activations", gpu=on_gpu_blocks * kept_per_block + window * kept_per_block,
                   note=f"{kept_per_block / GiB:.2f} GiB/block"
                        f"{' (checkpointed)' if checkpoint else ''} x {on_gpu_blocks} blocks"
                        + (f" + {window} reloading" if k else ""))
        if checkpoint:
            act.gpu += per_block  # the block being recomputed in backward
            act.note += " + 1 recomputed"
        if k:
            setattr(act, "host" if activation_tier == "cpu" else "nvme", k * kept_per_block)
            act.note += f"; {k} blocks offloaded to {activation_tier}"
        items.append(act)
        if bf and grad_accumulation_steps > 1:  # Note [breadth-first blocks]
            waiting = grad_accumulation_steps - 1
            items.append(Item("breadth-first block inputs",
                              gpu=waiting * (bf * kept_per_block + block_input),
                              note=f"{waiting} micro-batches x ({bf} blocks' saved + 1 hidden)"))
        items.append(Item("head + loss", gpu=head, note="logits, fp32 log-softmax, grads"))
        items.append(Item("reserve", gpu=gpu_reserve, host=host_reserve,
                          note="CUDA context/workspace/fragmentation; OS + Python"))
        if tier == "split":  # HybridAdam state_tier="split": RAM first, the rest on NVMe
            host_free = cap["host"] - sum(i.host for i in items)
            state_item.host = max(0, min(state, host_free))
            state_item.nvme = state - state_item.host
            state_item.note += f"; {state_item.host / max(state, 1):.0%} in RAM, rest on NVMe"
        used = {t: sum(getattr(i, t) for i in items) for t in ("gpu", "host", "nvme")}
        reasons = [f"{t} needs {used[t] / GiB:,.1f} GiB, has {cap[t] / GiB:,.1f} GiB "
                   f"(over by {(used[t] - cap[t]) / GiB:,.1f} GiB)"
                   for t in ("gpu", "host", "nvme") if used[t] > cap[t]]
        return Plan(n, active, not reasons, f, tier, k, checkpoint, items, dict(cap), used,
                    reasons, inputs=inputs, breadth_first_blocks=bf)

    def gpu_fixed(k: int) -> int:
        return build(1.0, "cpu", k).used["gpu"]

    def min_fraction(k: int) -> float:
        room = cap["gpu"] - gpu_fixed(k)
        if room >= n * gpu_state_per_param:
            return 0.0
        f = math.ceil((1.0 - room / (n * gpu_state_per_param)) * 100) / 100
        return f  # > 1 when even full offload does not fit

    layer_options = [offload_layers] if offload_layers is not None else \
        sorted({0, n_layers - 1})
    tiers = ["cpu", "split"] if state_tier == "auto" else [state_tier]  # split beats all-nvme
    best: Plan | None = None
    for k in layer_options:
        f = offload_fraction if offload_fraction is not None else min(1.0, min_fraction(k))
        for tier in tiers:
            candidate = build(f, tier, k)
            if candidate.fits:
                best = candidate
                break
            if best is None or _overflow(candidate) < _overflow(best):
                best = candidate  # the nearest miss: GPU fitting first, then least overflow
        if best is not None and best.fits:
            break
    assert best is not None
    if auto_blocks and best.fits:  # the most blocks that still fit this placement
        best = next((c for c in (build(best.offload_fraction, best.state_tier,
                                       best.offload_layers, bf)
                                 for bf in range(n_layers, 0, -1)) if c.fits), best)
    state_item = next(i for i in best.items if i.name == "optimizer state, offloaded")
    off_n = round(best.offload_fraction * n)
    chunk = _largest_chunk(off_n, chunk_numel)
    best.step_time = step_time(
        active_params=active, offloaded_params=off_n, param_bytes=p,
        moments_dtype=moments_dtype, checkpoint=checkpoint, micro_batch_tokens=batch * seq,
        grad_accumulation_steps=grad_accumulation_steps, nvme_state_bytes=state_item.nvme,
        activation_offload_bytes=best.offload_layers * kept_per_block,
        activation_tier=activation_tier, gpu_step_fraction=gpu_step_fraction,
        max_grad_norm=max_grad_norm, offloaded_chunks=-(-off_n // chunk) if chunk else 0,
        param_sync=param_sync, breadth_first_blocks=best.breadth_first_blocks,
        n_layers=n_layers, rates=rates)
    _add_notes(best, n, cap, host_reserve, param_dt, moments_dtype,
               dict(chunk_numel=chunk_numel, nvme_lookahead_chunks=nvme_lookahead_chunks))
    return best


def _overflow(p: Plan) -> tuple[int, int]:
    over = {t: max(0, p.used[t] - p.capacity[t]) for t in p.capacity}
    return over["gpu"], sum(over.values())


def _add_notes(pl: Plan, n: int, cap: dict, host_reserve: int, param_dt: torch.dtype,
               moments_dtype: str, optimizer: dict) -> None:
    """Add the configuration (fits) or the hints (does not fit) to ``pl.notes``;
    ``moments_dtype`` is a canonical name, ``optimizer`` HybridAdam's ``chunk_numel`` and
    ``nvme_lookahead_chunks``."""
    f = pl.offload_fraction
    p = param_dt.itemsize
    if pl.fits:
        cfg = [f"optimizer.offload_fraction={f:g}"]
        if f > 0:
            cfg.append(f"optimizer.state_tier={pl.state_tier}")
        if moments_dtype != "float32":
            cfg.append(f"optimizer.moments_dtype={moments_dtype}")
        if f > 0 and pl.inputs.get("gpu_step_fraction"):
            cfg.append(f"optimizer.gpu_step_fraction={pl.inputs['gpu_step_fraction']:g}")
        cfg.append(f"activations.enabled={'true' if pl.offload_layers else 'false'}")
        if pl.offload_layers:
            cfg.append(f"activations.num_layers={pl.offload_layers}")
        if pl.state_tier == "nvme" and f > 0:
            cfg.append("store.nvme_dir=/path/on/ssd")
        if pl.breadth_first_blocks:
            cfg.append(f"train.breadth_first_blocks={pl.breadth_first_blocks}")
        pl.notes.append("configure: " + " ".join(cfg))
        if f == 0 and not pl.offload_layers:
            pl.notes.append("fits on the GPU alone: tiermem is not needed for memory "
                            "(offload only costs time here)")
        return
    over = {t: pl.used[t] > cap[t] for t in cap}
    if over["gpu"]:
        if f < 1.0:
            bf16 = "" if moments_dtype != "float32" else (
                f", or use bf16 moments (--moments-dtype bf16, optimizer.moments_dtype=bfloat16: "
                f"the GPU-side state falls from {gpu_side_state_bytes(1, param_dt, torch.float32)}"
                f" to {gpu_side_state_bytes(1, param_dt, torch.bfloat16)} B/param)")
            pl.notes.append(f"the GPU overflows: raise the offload fraction (now {f:g}; "
                            f"--offload-fraction auto finds the least that fits) or offload "
                            f"activations{bf16}")
        else:
            pl.notes.append("the GPU overflows even with all optimizer state off it: offload "
                            "activations (activations.num_layers), use checkpointing, a smaller "
                            "micro-batch or shorter sequences; parameters and gradients "
                            f"themselves take {2 * p * n / GiB:,.0f} GiB")
    if (over["host"] or over["nvme"]) and f > 0:
        if f == 1.0:  # could the offloaded state fit anywhere at all? (RAM + NVMe together)
            total = cap["host"] + cap["nvme"]
            for name in MOMENTS_DTYPES:
                moments = getattr(torch, name)
                per = 4 * state_numel(1, moments)
                need = n * per
                # state_tier="split": the pinned rings and the NVMe staging stay in RAM
                buffers = sum(host_buffer_bytes(n, optimizer["chunk_numel"], param_dt, moments,
                                                optimizer["nvme_lookahead_chunks"], "split"))
                both = max(0, cap["host"] - host_reserve - buffers) + cap["nvme"]
                if need > total:
                    verdict = f"more than RAM + NVMe together ({total / GiB:,.0f} GiB): no " \
                              f"placement fits"
                elif need > both:
                    verdict = f"RAM + NVMe hold {both / GiB:,.0f} GiB after the pinned " \
                              f"staging ({buffers / GiB:,.1f} GiB) and the host reserve: no " \
                              f"placement fits"
                else:
                    verdict = f"RAM + NVMe hold it ({both / GiB:,.0f} GiB after staging) split " \
                              f"between them: optimizer.state_tier=split"
                pl.notes.append(f"with {_short(name)} moments the optimizer state of all "
                                f"{n / 1e9:.1f}B params is {need / GiB:,.0f} GiB ({per} B/param): "
                                f"{verdict}")
        elif moments_dtype == "float32":
            pl.notes.append(f"the offloaded state overflows its tier: bf16 moments "
                            f"(--moments-dtype bf16, optimizer.moments_dtype=bfloat16) cut it "
                            f"from 12 to 8 B/param, and the GPU side's from "
                            f"{gpu_side_state_bytes(1, param_dt, torch.float32)} to "
                            f"{gpu_side_state_bytes(1, param_dt, torch.bfloat16)} B/param, so "
                            f"the GPU may keep more of it (--offload-fraction auto finds the "
                            f"least that fits); or lower the offload fraction if the GPU has "
                            f"room")


# ---------------------------------------------------------------------------------- CLI


def _fraction(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in [0, 1] or 'auto'") from None


def _layers(text: str) -> int | None:
    value = blocks_or_auto(text)
    return None if value == "auto" else value


def blocks_or_auto(text: str) -> int | str:
    """The ``--breadth-first-blocks`` argument: an int, or ``"auto"``.

    Raises:
        argparse.ArgumentTypeError: neither.
    """
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int or 'auto'") from None


def _share(text: str) -> float:
    try:
        return float(text)  # the range is plan()'s check, one message for both
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in [0, 1]") from None


def _norm(text: str) -> float:
    try:
        return float(text)  # the range is plan()'s check, one message for both
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (a clipping norm > 0, "
                                         f"e.g. 1.0)") from None


def _count(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 13e9)") from None
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tiermem plan",
        description="Say what must go where (GPU / pinned host RAM / NVMe) to train a GPT-style "
                    "model (dense, or mixture of experts with --experts, --top-k and --d-expert), "
                    "and whether it fits. Exit code 0: fits; 1: does not fit; 2: bad "
                    "usage. The memory model is documented in tiermem/plan.py and "
                    "docs/design.md.")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--model-size", choices=sorted(PRESETS, key=lambda s: float(s[:-1])),
                      help="a GPT preset (vocab 32000, seq 2048; 1b: 24x2048 micro-batch 8, "
                           "7b: 32x4096, 13b: 40x5120, 30b: 60x6656, 70b: 80x8192, batch 1)")
    size.add_argument("--params", type=_count, help="parameter count, e.g. 13e9 "
                      "(needs --layers and --d-model; for an MoE all parameters, and optional: "
                      "counted from the shape)")
    p.add_argument("--layers", type=int, help="transformer blocks")
    p.add_argument("--d-model", type=int, help="model width")
    p.add_argument("--heads", type=int, help="attention heads (eager attention only)")
    p.add_argument("--vocab", type=int, help="vocabulary size (default 32000)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default 2048)")
    p.add_argument("--batch", type=int, help="sequences per micro-batch (default: preset's, or 1)")
    p.add_argument("--experts", type=int, help="MoE: experts per block (with --top-k, --d-expert)")
    p.add_argument("--top-k", type=int, help="MoE: experts each token is routed to")
    p.add_argument("--d-expert", type=int, help="MoE: hidden width of each expert's MLP")
    p.add_argument("--dtype", default="bf16",
                   help="parameter dtype: bf16, fp32 or fp16, or their long names (bfloat16, "
                        "...) (default bf16)")
    p.add_argument("--moments-dtype", default="fp32",
                   help="dtype of the Adam moments, on the GPU and offloaded alike: fp32 or "
                        "bf16, or their long names (default fp32)")
    p.add_argument("--gpu", default="141GB",
                   help="GPU capacity (default 141GB = 131.3 GiB: one H200; output is in GiB)")
    p.add_argument("--host", default="128GiB", help="host RAM (default 128GiB)")
    p.add_argument("--nvme", default="64GiB", help="NVMe space for spill files (default 64GiB)")
    p.add_argument("--gpu-reserve", default=None,
                   help="GPU bytes kept free (default 1GiB + 5%% of --gpu)")
    p.add_argument("--host-reserve", default="8GiB", help="host bytes kept free (default 8GiB)")
    p.add_argument("--offload-fraction", type=_fraction, default=None, metavar="F|auto",
                   help="optimizer state off the GPU, 0..1 (default auto: the least that fits)")
    p.add_argument("--state-tier", default="auto", choices=["auto", "cpu", "nvme", "split"],
                   help="where offloaded state lives (default auto: RAM, else split RAM + NVMe)")
    p.add_argument("--offload-layers", type=_layers, default=None, metavar="K|auto",
                   help="blocks whose activations are offloaded (default auto)")
    p.add_argument("--activation-tier", default="cpu", choices=["cpu", "nvme"],
                   help="where offloaded activations go (default cpu)")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing")
    p.add_argument("--prefetch-depth", type=int, default=1, help="blocks reloaded ahead (1)")
    p.add_argument("--eager-attention", action="store_true",
                   help="attention saves its softmax (no flash/efficient SDPA kernel)")
    p.add_argument("--gpu-step-fraction", type=_share, default=0.0, metavar="S",
                   help="share of the offloaded chunks HybridAdam's GPU lane steps "
                        "(optimizer.gpu_step_fraction), 0..1, for the time per step: that share "
                        "crosses PCIe as state both ways instead of being stepped by the CPU "
                        "(default 0: the CPU steps all)")
    p.add_argument("--max-grad-norm", type=_norm, default=None, metavar="X",
                   help="HybridAdam's gradient clipping norm (optimizer.max_grad_norm), for the "
                        "time per step: with it the optimizer phase cannot overlap backward (it "
                        "waits for the global norm), so the floor step is the GPU's time plus "
                        "the whole optimizer phase (default: no clipping)")
    p.add_argument("--grad-accumulation-steps", type=int, default=1, metavar="N",
                   help="micro-batches per optimizer step, for the time per step: tokens per "
                        "step = batch x seq x N (default 1; the memory depends on it only with "
                        "--breadth-first-blocks)")
    p.add_argument("--param-sync", choices=PARAM_SYNCS, default="step",
                   help="HybridAdam's param_sync (optimizer.param_sync), for the time per "
                        "step: with 'forward' and --max-grad-norm the next forward runs beside "
                        "the optimizer's tail (default: step)")
    p.add_argument("--breadth-first-blocks", type=blocks_or_auto, default=0, metavar="K",
                   help="blocks run for every micro-batch first (train.breadth_first_blocks), "
                        "or 'auto': the most that fit; their saved inputs count on the GPU, and "
                        "with --param-sync forward their forward runs beside the optimizer's "
                        "tail (default 0)")
    rates = p.add_argument_group(
        "machine rates", "what the time per optimizer step is predicted from (defaults: the "
        "H200 machine, one run each, docs/results/*.log; docs/sizing.md)")
    d = MachineRates()
    for flag, fld, scale, unit, log in _RATE_FLAGS:
        rates.add_argument(flag, type=_rate, default=None, metavar=unit.split()[0],
                           help=f"{unit} (default {getattr(d, fld) / scale:,.2f}, {log})")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


_RATE_FLAGS = (
    ("--gpu-tflops", "gpu_flops", 1e12, "TFLOP/s of forward + backward counted as 6·N·tokens",
     "bench_activations.log"),
    ("--gpu-tflops-checkpointed", "gpu_flops_checkpointed", 1e12,
     "TFLOP/s of forward + backward with every block checkpointed, counted as 8·N·tokens",
     "bench_activations.log"),
    ("--pcie-h2d", "pcie_h2d_bytes_per_s", 1e9, "GB/s host to device", "bench_transfer.log"),
    ("--pcie-d2h", "pcie_d2h_bytes_per_s", 1e9, "GB/s device to host", "bench_transfer.log"),
    ("--pcie-both", "pcie_both_bytes_per_s", 1e9, "GB/s both directions at once",
     "bench_transfer.log"),
    ("--cpu-adam", "cpu_adam_params_per_s", 1e9, "Gparams/s of CPU Adam, fp32 moments",
     "bench_adam.log"),
    ("--cpu-adam-bf16", "cpu_adam_bf16_moments_params_per_s", 1e9,
     "Gparams/s of CPU Adam, bf16 moments", "bench_adam.log"),
    ("--nvme-read", "nvme_read_bytes_per_s", 1e9, "GB/s spill-file reads", "bench_io.log"),
    ("--nvme-write", "nvme_write_bytes_per_s", 1e9, "GB/s spill-file writes", "bench_io.log"),
)
"""``tiermem plan``'s rate options: flag, :class:`MachineRates` field, unit scale, unit, log."""


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def breadth_first_note(result: Plan, num_params, kw: dict) -> str | None:
    """With ``max_grad_norm`` and micro-batches, when the run does not already use it: what
    ``param_sync="forward"`` with ``breadth_first_blocks="auto"`` would predict, as a note for
    :attr:`Plan.notes` (None: nothing to add, or it would not fit or not be faster).
    ``result`` is ``plan(num_params, **kw)``.

    Raises:
        ValueError, TypeError: what :func:`plan` raises for these inputs.
    """
    st = result.step_time
    if (not result.fits or st is None or st.max_grad_norm is None or result.offload_fraction == 0
            or kw["grad_accumulation_steps"] < 2
            or (st.param_sync == "forward" and st.breadth_first_blocks)):
        return None
    alt = plan(num_params, **{**kw, "param_sync": "forward", "breadth_first_blocks": "auto",
                              "offload_fraction": result.offload_fraction})
    ast = alt.step_time
    if not alt.fits or ast is None or not alt.breadth_first_blocks \
            or ast.overlapped_s >= st.overlapped_s:
        return None
    return (f"faster: --param-sync forward --breadth-first-blocks auto (one process): the first "
            f"{alt.breadth_first_blocks} blocks of every micro-batch run before the rest, so "
            f"{ast.forward_overlap_s:.2f} s of the next forward runs beside the optimizer's "
            f"tail: predicted {ast.overlapped_s:.2f} s (floor) instead of {st.overlapped_s:.2f}"
            f" s, the same gradients (Note [breadth-first blocks] in "
            f"tiermem/schedule/micro_batches.py)")


def main(argv: list[str] | None = None) -> int:
    """Run ``tiermem plan``; return 0 (fits), 1 (does not fit) or 2 (bad usage).

    Bad usage prints one line (or argparse's usage message) on stderr and returns 2.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return int(exc.code or 0)
    try:
        moe = dict(n_experts=args.experts, top_k=args.top_k, d_expert=args.d_expert)
        is_moe = any(v is not None for v in moe.values())
        if args.model_size is None and args.params is None and not is_moe:
            raise ValueError("give the model: --model-size 1b|7b|13b|30b|70b, --params N "
                             "with --layers and --d-model, or an MoE: --layers, --d-model, "
                             "--experts, --top-k and --d-expert")
        shape = PRESETS.get(args.model_size)
        kw = dict(
            n_layers=args.layers or (shape.n_layers if shape else None),
            d_model=args.d_model or (shape.d_model if shape else None),
            n_heads=args.heads or (shape.n_heads if shape else None),
            vocab=args.vocab or (shape.vocab if shape else 32000),
            seq=args.seq or (shape.seq_len if shape else 2048),
            batch=args.batch or (shape.micro_batch if shape else 1),
            dtype=args.dtype, moments_dtype=args.moments_dtype, gpu_bytes=args.gpu,
            host_bytes=args.host, nvme_bytes=args.nvme, gpu_reserve_bytes=args.gpu_reserve,
            host_reserve_bytes=args.host_reserve, offload_fraction=args.offload_fraction,
            state_tier=args.state_tier, offload_layers=args.offload_layers,
            activation_tier=args.activation_tier, checkpoint=args.checkpoint,
            prefetch_depth=args.prefetch_depth, eager_attention=args.eager_attention,
            grad_accumulation_steps=args.grad_accumulation_steps,
            gpu_step_fraction=args.gpu_step_fraction, max_grad_norm=args.max_grad_norm,
            param_sync=args.param_sync, breadth_first_blocks=args.breadth_first_blocks,
            rates=MachineRates(**{fld: getattr(args, flag[2:].replace("-", "_")) * scale
                                  for flag, fld, scale, _, _ in _RATE_FLAGS
                                  if getattr(args, flag[2:].replace("-", "_")) is not None}),
            **moe)
        if shape is not None:
            if args.layers or args.d_model:
                raise ValueError("--model-size sets the shape; use --params with --layers and "
                                 "--d-model for another shape")
            if is_moe:
                raise ValueError("--model-size is a dense GPT preset; for an MoE give --layers, "
                                 "--d-model, --experts, --top-k and --d-expert instead")
            n = dataclasses.replace(shape, vocab=kw["vocab"], seq_len=kw["seq"]).num_params()
        else:
            n = args.params
        result = plan(n, **kw)
        hint = breadth_first_note(result, n, kw)
    except (ValueError, TypeError) as exc:
        print(f"tiermem plan: error: {exc}", file=sys.stderr)
        return 2
    if hint:
        result.notes.append(hint)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.table(), end="")
    return 0 if result.fits else 1


if __name__ == "__main__":
    sys.exit(main())
