"""The time-per-step model of ``tiermem plan``: :func:`step_time` predicts one optimizer step
per resource (GPU, PCIe, CPU Adam, NVMe) from a placement and :class:`MachineRates`, and
:func:`step_time_lines` prints it.

Time per step (``plan.step_time``, :func:`step_time`; docs/sizing.md, "Time per step"): from the
placement and the tokens per optimizer step (``batch x seq x grad_accumulation_steps``), the
predicted seconds of GPU forward + backward, PCIe, CPU Adam and NVMe per optimizer step, from
:class:`MachineRates` (defaults: the H200 machine's logs in ``docs/results``), with HybridAdam's
``gpu_step_fraction`` (the GPU lane: its share of the offloaded params crosses PCIe as state
both ways instead of being stepped by the CPU), and the step's two ends: a floor where the
optimizer's resources pipeline per chunk after (part of) the last micro-batch's backward, and a
ceiling where nothing overlaps (Note [optimizer tail]). Predictions, not measurements.

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
  the recomputed forward of the ``6·N·T`` / ``8·N·T`` count); with ``max_grad_norm`` none,
  but for the chunks a rollback budget lets speculate (Note [speculated chunks]);
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

Note [speculated chunks]
~~~~~~~~~~~~~~~~~~~~~~~~
With ``max_grad_norm`` and a rollback budget (``rollback_bytes``: Note [speculative step] in
``tiermem/optim/speculate.py``) HybridAdam steps the first ``s = speculated_chunks`` of its
``C`` offloaded chunks in backward order as their gradients land, as without clipping, betting
that the norm does not clip; the other ``C - s`` wait for the norm. The chunks being of one
size, the speculated ones take ``spec = opt_max·s/C`` of the pipelined phase: that overlaps the
backward window as without clipping, what of it outlasts the window runs first after the
backward, then the waiting chunks, beside which the next forward may run
(``forward_overlap_s``: they go in forward order). The tail: ``max(0, spec - window) + max(0,
opt_max - spec - forward_overlap_s)``; ``s = 0`` gives the clipped tail, ``s = C`` the
unclipped one. Not counted: the pre-step copies (a host memcpy of each speculated chunk's
state; the GPU lane's on the GPU) and a step whose norm clips (its speculated chunks are
restored and stepped again after the norm: about the clipped step plus the restores).

Note [scaler verdict]
~~~~~~~~~~~~~~~~~~~~~
Under a ``torch.amp.GradScaler`` (``grad_scaler=True``: fp16 training) HybridAdam's chunks
wait for ``step()``'s verdict (inf/NaN or not) from the second step on, also without
``max_grad_norm``, or speculate within ``rollback_bytes`` exactly as under clipping (Note
[grad scaler overlap] in ``tiermem/optim/amp_scaling.py``: the same rollback slots, the same
admission). So :func:`step_time` times such a step as a clipped one: the window only for the
speculated chunks, the rest after the backward; the bet is that the scaler finds no inf/NaN
(a skipped step restores the speculated chunks and applies nothing). The next forward runs
beside the waiting chunks (``param_sync="forward"``) only where they go in forward order:
with clipping, or under a scaler with speculated chunks (Note [held chunks] in
``tiermem/optim/speculate.py``); under a scaler alone without them they are queued in
backward order as their gradients land, and nothing is counted. A budget below one chunk's
state holds no slot, so nothing is counted there either, though ``step()`` then queues the
chunks in forward order (a prediction on the slow side).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tiermem import options
from tiermem.names import OFFLOAD_TIERS, check_choice, check_int
from tiermem.optim.layout import state_numel
from tiermem.rates import MachineRates
from tiermem.shapes import GiB

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
        overlap_window_s: seconds of backward the optimizer phase can overlap: the last
            micro-batch's backward, ``seconds["gpu"] / accumulation steps x 4/6`` (6/8 with
            checkpointing); with ``max_grad_norm`` or ``grad_scaler`` 0, or that window for
            the speculated chunks (Note [speculated chunks], Note [scaler verdict]).
        optimizer_tail_s: what the optimizer adds to forward + backward at the floor
            (seconds): ``max(0, optimizer_overlapped_s - overlap_window_s)`` (Note [speculated
            chunks] with a rollback budget), or more when the
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
        grad_scaler: a ``torch.amp.GradScaler`` drives the steps (Note [scaler verdict]).
        forward_overlap_s: seconds of the next step's forward that run beside the optimizer
            tail (Note [optimizer tail]): with ``param_sync="forward"`` and ``max_grad_norm``
            (or ``grad_scaler`` and speculated chunks: Note [scaler verdict]), the forward of
            the first ``breadth_first_blocks`` blocks of every micro-batch and
            of the rest of one; else 0.
        param_sync: HybridAdam's ``param_sync``.
        breadth_first_blocks: blocks run for every micro-batch first (Note [breadth-first
            blocks] in tiermem/schedule/micro_batches.py).
        stream_schedule: ``"block-major"`` or ``"depth-first"`` with streamed weights (Note
            [streaming plan] in ``tiermem/apps/plan/streaming.py``; ``moved`` then has
            ``stream_h2d_bytes``, ``stream_d2h_bytes`` and ``stream_nvme_read_bytes``); None:
            no weights streamed.
        stream_tier: the streamed weights' home, ``"cpu"`` or ``"nvme"`` (None: none).
        speculated_chunks: with ``max_grad_norm`` or ``grad_scaler``, the offloaded chunks
            stepped during backward on the rollback budget (Note [speculated chunks]); 0: all
            wait.
        speculated_s: their share of ``optimizer_overlapped_s`` (seconds).
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
    stream_schedule: str | None = None
    stream_tier: str | None = None
    speculated_chunks: int = 0
    speculated_s: float = 0.0
    grad_scaler: bool = False


def _field(dotted: str, who: str, value, name: str | None = None):
    """``value`` checked as the configuration field ``dotted`` (Note [one definition] in
    tiermem/options.py), named ``name`` in the message; normalized.

    Raises:
        ValueError, TypeError: a bad value.
    """
    return options.check(dotted, options.Who(who), value, "plan", name)


def step_time(*, active_params: int, offloaded_params: int, param_bytes: int,
              moments_dtype="float32", checkpoint: bool = False, micro_batch_tokens: int,
              grad_accumulation_steps: int = 1, nvme_state_bytes: int = 0,
              activation_offload_bytes: int = 0, activation_tier: str = "cpu",
              gpu_step_fraction: float = 0.0, max_grad_norm: float | None = None,
              offloaded_chunks: int = 0, speculated_chunks: int = 0, param_sync: str = "step",
              breadth_first_blocks: int = 0, n_layers: int | None = None,
              streamed_bytes: int = 0, stream_kept_bytes: int = 0,
              stream_schedule: str = "block-major", stream_tier: str = "cpu",
              grad_scaler: bool = False, rates: MachineRates | None = None) -> StepTime:
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
      ``activation_tier="nvme"``);
    - streamed weights (``streamed_bytes`` S > 0; Note [streaming plan] in
      ``tiermem/apps/plan/streaming.py``): ``2·S − K`` H2D (``K``: ``stream_kept_bytes``, the
      blocks kept into the backward, fetched once: Note [kept into backward]) and ``S`` of
      gradients D2H per pass, one pass per step block-major, one per micro-batch depth-first,
      during forward + backward; their params are neither sent back nor their gradients
      shipped in the optimizer phase (``S / param_bytes`` of the offloaded params leave the
      optimizer's PCIe bytes); with ``stream_tier="nvme"`` also ``2·S − K`` NVMe reads per
      pass (forward + backward) and ``S`` written per step (the update, in the optimizer
      phase).

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
        speculated_chunks: with ``max_grad_norm`` or ``grad_scaler``, the offloaded chunks
            whose pre-step copies the rollback budget holds (``rollback_slots``; at most
            ``offloaded_chunks``): they overlap the backward as without clipping (Note
            [speculated chunks]); 0: every chunk waits for the norm (the verdict).
        param_sync: HybridAdam's, ``"step"`` or ``"forward"`` (Note [forward sync]).
        breadth_first_blocks: blocks run for every micro-batch before the rest of the first
            (Note [breadth-first blocks]), 0 to ``n_layers``.
        n_layers: the model's blocks (needed with ``breadth_first_blocks``).
        streamed_bytes: bytes of the streamed blocks' weights (0: none streamed); their
            params must be among the offloaded ones.
        stream_kept_bytes: bytes of the streamed blocks' weights a forward keeps on the GPU
            for its backward (``StreamPlan.kept_bytes``), 0 to ``streamed_bytes``.
        stream_schedule: ``"block-major"`` or ``"depth-first"``.
        stream_tier: the streamed weights' home, ``"cpu"`` or ``"nvme"``.
        grad_scaler: a ``torch.amp.GradScaler`` drives the steps (fp16): the chunks wait for
            its verdict or speculate, as with ``max_grad_norm`` (Note [scaler verdict]).
        rates: :class:`MachineRates`; None: the H200 machine's.

    Raises:
        ValueError, TypeError: a count that is not a positive int (zero allowed for the
            offloaded and NVMe ones), an unknown dtype or tier, ``gpu_step_fraction`` not a
            number in [0.0, 1.0], ``max_grad_norm`` not a number > 0 (or None), ``rates``
            not MachineRates, an unknown ``param_sync``, ``breadth_first_blocks`` above
            ``n_layers`` or given without it, ``streamed_bytes`` not a whole number of
            params or more params than are offloaded, ``stream_kept_bytes`` not whole params
            or above ``streamed_bytes``, an unknown schedule or stream tier,
            ``speculated_chunks`` above ``offloaded_chunks`` or without ``max_grad_norm``
            and ``grad_scaler``, ``grad_scaler`` not a bool.
    """
    who = "step_time: "
    rates = MachineRates() if rates is None else rates
    if not isinstance(rates, MachineRates):
        raise TypeError(f"{who}rates must be a tiermem.apps.plan.MachineRates, got "
                        f"{type(rates).__name__}")
    check_int(who, "active_params", active_params)
    check_int(who, "param_bytes", param_bytes)
    check_int(who, "micro_batch_tokens", micro_batch_tokens)
    check_int(who, "grad_accumulation_steps", grad_accumulation_steps)
    for name, value in (("offloaded_params", offloaded_params),
                        ("nvme_state_bytes", nvme_state_bytes),
                        ("activation_offload_bytes", activation_offload_bytes),
                        ("offloaded_chunks", offloaded_chunks),
                        ("speculated_chunks", speculated_chunks),
                        ("streamed_bytes", streamed_bytes),
                        ("stream_kept_bytes", stream_kept_bytes)):
        check_int(who, name, value, low=0)
    check_choice(who, "stream_schedule", stream_schedule, ("block-major", "depth-first"))
    check_choice(who, "stream_tier", stream_tier, OFFLOAD_TIERS)
    streamed_params, odd = divmod(streamed_bytes, param_bytes)
    if odd or streamed_params > offloaded_params:
        raise ValueError(f"{who}streamed_bytes={streamed_bytes} must be whole params of "
                         f"param_bytes={param_bytes} among the offloaded_params="
                         f"{offloaded_params} (a streamed weight is stepped on the host)")
    if stream_kept_bytes % param_bytes or stream_kept_bytes > streamed_bytes:
        raise ValueError(f"{who}stream_kept_bytes={stream_kept_bytes} must be whole params of "
                         f"param_bytes={param_bytes}, at most streamed_bytes={streamed_bytes} "
                         f"(the kept blocks are streamed ones: StreamPlan.kept_bytes)")
    moments = _field("optimizer.moments_dtype", who, moments_dtype)
    _field("activations.tier", who, activation_tier, "activation_tier")
    share = _field("optimizer.gpu_step_fraction", who, gpu_step_fraction)
    _field("optimizer.max_grad_norm", who, max_grad_norm)
    if not isinstance(grad_scaler, bool):
        raise TypeError(f"{who}grad_scaler={grad_scaler!r} must be True (a torch.amp.GradScaler "
                        f"drives the steps) or False")
    waits = max_grad_norm is not None or grad_scaler  # Note [scaler verdict]
    if speculated_chunks > offloaded_chunks or (speculated_chunks and not waits):
        raise ValueError(f"{who}speculated_chunks={speculated_chunks} needs max_grad_norm (or "
                         f"grad_scaler) and at most offloaded_chunks={offloaded_chunks} (the "
                         f"chunks the rollback budget holds; Note [speculated chunks]): give 0 "
                         f"to {offloaded_chunks} with max_grad_norm or grad_scaler, else 0")
    _field("optimizer.param_sync", who, param_sync)
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
    opt_bytes = (cpu_params - streamed_params) * param_bytes + lane_bytes
    # Note [streaming plan]: per pass S gradients D2H and 2·S - K weights H2D (the K kept into
    # the backward fetched once), as many NVMe reads with the weights there; one pass per step
    # block-major (fixed), one per micro-batch depth-first (per token)
    per_mb = stream_schedule == "depth-first"

    def per_pass(nbytes: int) -> tuple[float, float]:  # (fixed, per token) of bytes per pass
        return (0.0, nbytes / micro_batch_tokens) if per_mb else (float(nbytes), 0.0)

    s_fixed, s_per = per_pass(streamed_bytes)  # the gradients, D2H
    f_fixed, f_per = per_pass(2 * streamed_bytes - stream_kept_bytes)  # the fetches, H2D
    s_read = 1 if stream_tier == "nvme" else 0  # NVMe reads per fetched byte
    s_write = streamed_bytes if stream_tier == "nvme" else 0  # the update, once per step
    adam_rate = r.cpu_adam_params_per_s if moments == "float32" else \
        r.cpu_adam_bf16_moments_params_per_s
    disk = 1 / r.nvme_read_bytes_per_s + 1 / r.nvme_write_bytes_per_s  # s per byte read + written
    # (fixed seconds, seconds per token) of each term; a resource takes its largest term
    terms = {
        "pcie": [((opt_bytes + s_fixed) / r.pcie_d2h_bytes_per_s,
                  (act_per_token + s_per) / r.pcie_d2h_bytes_per_s),
                 ((opt_bytes + f_fixed) / r.pcie_h2d_bytes_per_s,
                  (act_per_token + f_per) / r.pcie_h2d_bytes_per_s),
                 ((2 * opt_bytes + s_fixed + f_fixed) / r.pcie_both_bytes_per_s,
                  (2 * act_per_token + s_per + f_per) / r.pcie_both_bytes_per_s)],
        "cpu_adam": [(cpu_params / adam_rate + offloaded_chunks * r.worker_s_per_chunk, 0.0)],
        "nvme": [(nvme_state_bytes * disk + s_write / r.nvme_write_bytes_per_s
                  + s_read * f_fixed / r.nvme_read_bytes_per_s,
                  (act_per_token * disk if activation_tier == "nvme" else 0.0)
                  + s_read * f_per / r.nvme_read_bytes_per_s)],
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
    s_step = s_fixed + s_per * tokens  # gradients D2H per step: S or M·S
    f_step = f_fixed + f_per * tokens  # weights H2D per step: 2·S - K or M·(2·S - K)
    # forward + backward: the GPU's work, or the traffic that runs during it if longer
    fwd_bwd = max(seconds["gpu"],
                  (act_bytes + s_step) / r.pcie_d2h_bytes_per_s,
                  (act_bytes + f_step) / r.pcie_h2d_bytes_per_s,
                  (2 * act_bytes + s_step + f_step) / r.pcie_both_bytes_per_s,
                  (act_bytes * disk if activation_tier == "nvme" else 0.0)
                  + s_read * f_step / r.nvme_read_bytes_per_s)
    opt = (opt_bytes * pcie_per_byte, seconds["cpu_adam"],
           nvme_state_bytes * disk + s_write / r.nvme_write_bytes_per_s)
    window = 0.0 if waits and not speculated_chunks else \
        seconds["gpu"] / grad_accumulation_steps * ((6 / 8) if checkpoint else (4 / 6))
    # Note [speculated chunks]: the optimizer work that may overlap the window: every chunk's
    # unless the step waits for the norm or the scaler's verdict, else the speculated share
    if not waits:
        spec = max(opt)
    else:
        spec = max(opt) * speculated_chunks / offloaded_chunks if speculated_chunks else 0.0
    # Note [optimizer tail]: the next forward beside the tail (chunks stepped in forward order:
    # with clipping, under a scaler only with speculated chunks: Note [scaler verdict])
    ahead = 0.0
    if param_sync == "forward" and (max_grad_norm is not None
                                    or (grad_scaler and speculated_chunks)):
        first = breadth_first_blocks / n_layers if breadth_first_blocks else 0.0
        ahead = seconds["gpu"] * ((2 / 8) if checkpoint else (2 / 6)) * (
            first + (1 - first) / grad_accumulation_steps)
    # at least the busiest resource's own time: a link or disk carrying both activations
    # and optimizer traffic does not do both at once
    # (Note [speculated chunks]: what of the window's work outlasts it, then the rest, which
    # the next forward may overlap)
    tail = max(0.0, max(0.0, spec - window) + max(0.0, max(opt) - spec - ahead),
               seconds[bound] - fwd_bwd)
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
                 pcie_d2h_bytes=float(opt_bytes + act_total + s_step),
                 pcie_h2d_bytes=float(opt_bytes + act_total + f_step),
                 pcie_gpu_lane_bytes=float(lane_bytes),
                 cpu_adam_params=float(cpu_params),
                 offloaded_chunks=float(offloaded_chunks),
                 gpu_lane_params=float(lane_params),
                 nvme_read_bytes=float(nvme_state_bytes + s_read * f_step
                                       + (act_total if activation_tier == "nvme" else 0)),
                 nvme_write_bytes=float(nvme_state_bytes + s_write
                                        + (act_total if activation_tier == "nvme" else 0)))
    if streamed_bytes:
        moved.update(stream_h2d_bytes=float(f_step), stream_d2h_bytes=float(s_step),
                     stream_nvme_read_bytes=float(s_read * f_step),
                     stream_nvme_write_bytes=float(s_write))
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
                    param_sync=param_sync, breadth_first_blocks=breadth_first_blocks,
                    stream_schedule=stream_schedule if streamed_bytes else None,
                    stream_tier=stream_tier if streamed_bytes else None,
                    speculated_chunks=speculated_chunks,
                    speculated_s=spec if waits else 0.0, grad_scaler=grad_scaler)


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
    gpu_rate = st.rates.gpu_flops_checkpointed if checkpoint else st.rates.gpu_flops
    what = {
        "gpu": f"{c} x {m['gpu_flops'] / c / st.tokens / 1e9:,.2f}B params x tokens at "
               f"{gpu_rate / 1e12:,.1f} TFLOP/s"
               + (" (checkpointing: the forward twice)" if checkpoint else ""),
        "pcie": f"{m['pcie_d2h_bytes'] / GiB:,.1f} GiB D2H + {m['pcie_h2d_bytes'] / GiB:,.1f} "
                f"GiB H2D" + (f" (of which {m['pcie_gpu_lane_bytes'] / GiB:,.1f} GiB each way: "
                              f"the state of the {m['gpu_lane_params'] / 1e9:,.2f}B params the "
                              f"GPU lane steps, gpu_step_fraction={st.gpu_step_fraction:g})"
                              if m.get("gpu_lane_params") else "")
                + (f" (of which {m['stream_h2d_bytes'] / GiB:,.1f} GiB H2D streamed weights and "
                   f"{m['stream_d2h_bytes'] / GiB:,.1f} GiB D2H their gradients, during fwd+bwd)"
                   if m.get("stream_h2d_bytes") else ""),
        "cpu_adam": f"{m['cpu_adam_params'] / 1e9:,.2f}B params"
                    + (" (the rest of the offloaded: GPU lane)" if m.get("gpu_lane_params")
                       else "")
                    + (f" + {m['offloaded_chunks']:,.0f} chunks x "
                       f"{st.rates.worker_s_per_chunk * 1e3:.2f} ms (the worker's own time)"
                       if m.get("offloaded_chunks") else ""),
        "nvme": f"{m['nvme_read_bytes'] / GiB:,.1f} GiB read + {m['nvme_write_bytes'] / GiB:,.1f}"
                f" GiB written" + (f" (of which the streamed weights "
                                   f"{m['stream_nvme_read_bytes'] / GiB:,.1f} GiB read + "
                                   f"{m['stream_nvme_write_bytes'] / GiB:,.1f} GiB written)"
                                   if m.get("stream_nvme_read_bytes") else ""),
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
    clip = st.max_grad_norm is not None
    # Note [scaler verdict]: what the chunks that do not speculate wait for, and what undoes
    verdict = " and ".join(
        ([f"the global norm (max_grad_norm={st.max_grad_norm:g})"] if clip else [])
        + (["the GradScaler's verdict"] if st.grad_scaler else []))
    undo = " or ".join((["the norm clips"] if clip else [])
                       + (["the scaler skips the step"] if st.grad_scaler else []))
    if (clip or st.grad_scaler) and st.speculated_chunks:  # Note [speculated chunks]
        c, s = round(m["offloaded_chunks"]), st.speculated_chunks
        window = (f"overlaps up to {st.overlap_window_s:.3f} s of backward with the {s} of {c} "
                  f"chunks the rollback budget lets speculate (the first in backward order, "
                  f"{st.speculated_s:.3f} s of the phase; rolled back if {undo}), "
                  + (f"the other {c - s}" if c > s else "none") + f" wait for {verdict}")
    elif clip and not st.grad_scaler:
        window = (f"overlaps no backward (max_grad_norm={st.max_grad_norm:g}: the CPU step waits "
                  f"for the global norm)")
    elif st.grad_scaler:
        window = f"overlaps no backward (the CPU step waits for {verdict})"
    else:
        window = (f"overlaps up to {st.overlap_window_s:.3f} s of backward (the last "
                  f"micro-batch's, {'6/8' if checkpoint else '4/6'} of its GPU time: gradients "
                  f"are shipped on the last pass only)")
    if st.forward_overlap_s:
        first = (f"the first {st.breadth_first_blocks} blocks of every micro-batch and the rest "
                 f"of one" if st.breadth_first_blocks else "one micro-batch")
        window += (f"; the next forward runs {st.forward_overlap_s:.3f} s beside it "
                   f"(param_sync='forward': {first})")
    if st.stream_schedule:
        lines.append("  " + stream_line(st))
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
        traffic = "the streamed weights' and offloaded activations'" if st.stream_schedule \
            else "the offloaded activations'"
        fwd_bwd = "GPU fwd+bwd" if st.fwd_bwd_s == gpu else f"fwd+bwd ({traffic} traffic)"
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
        what = "offloaded activations or depth-first streamed weights" if st.stream_schedule \
            else "offloaded activations"
        lines.append(f"  the GPU's time exceeds the others' at no batch: {what} "
                     f"cross PCIe (or NVMe) faster per token than the GPU computes; {share}")
    else:
        lines.append(f"  the GPU's time exceeds the optimizer's from {st.gpu_bound_tokens:,} "
                     f"tokens per optimizer step (grad_accumulation_steps >= "
                     f"{st.gpu_bound_grad_accumulation_steps} at {st.micro_batch_tokens:,} "
                     f"tokens per micro-batch); {share}")
    return lines


def stream_line(st: StepTime) -> str:
    """What the weight stream moves per step and on which schedule (Note [streaming plan] in
    ``tiermem/apps/plan/streaming.py``), for :func:`step_time_lines`.

    Raises:
        nothing: formatting of a :class:`StepTime` with streamed weights.
    """
    m = st.moved
    accum = st.tokens // st.micro_batch_tokens
    s, h = m["stream_d2h_bytes"] / GiB, m["stream_h2d_bytes"] / GiB
    # Note [kept into backward]: the blocks a forward keeps for its backward are fetched once
    kept = "the last ones, kept on the GPU from forward into backward, once"
    if st.stream_schedule == "block-major":
        how = (f"block-major (the default when streaming): each streamed block's weights cross "
               f"twice per pass over the {accum} micro-batch{'es' if accum > 1 else ''} "
               f"({kept}), {h:,.1f} GiB H2D + {s:,.1f} GiB of gradients D2H per step; "
               f"depth-first moves that once per micro-batch")
    else:
        per = "" if accum == 1 else f" over {accum} micro-batches"
        how = (f"depth-first: {h:,.1f} GiB H2D + {s:,.1f} GiB of gradients D2H per "
               f"step{per} (each micro-batch fetches every streamed block twice, {kept})")
    home = " from NVMe (read at every fetch)" if st.stream_tier == "nvme" else ""
    return (f"weights streamed{home}, {how}; during forward + backward, so fwd+bwd is the "
            f"longer of the GPU's time and this traffic's (a prediction)")
