"""Weight streaming in the plan: which blocks stay resident on the GPU, the streaming buffers,
where the streamed weights and their gradients live on the host, and what they move per step
(Note [streaming plan]). :func:`tiermem.apps.plan.plan` calls :func:`place_stream` for every
placement it tries with ``stream_weights``; :func:`tiermem.apps.plan.timing.step_time` times the
traffic. Predictions: the 8B preset's H200 run (docs/benchmarks.md, session 15) took 5.88 s
a step against a predicted 5.18-5.63 s.

Note [streaming plan]
~~~~~~~~~~~~~~~~~~~~~
With weights streamed (issue 29; docs/streaming.md) the GPU holds, besides the optimizer state
it keeps, the activations, the head and the reserve:

- the weights and gradients of what is not a block (embeddings, final LayerNorm, head) and of
  the resident blocks: ordinary device parameters, their gradients on the device until
  HybridAdam copies them;
- the streaming buffers: ``prefetch_blocks + 2`` blocks (at most the streamed ones) at the
  largest streamed block's size (Note [resident blocks] in ``tiermem/stream/residency.py``),
  each counted with its weights *and* its gradient: the block in backward produces its
  gradient there before it leaves, so a buffer holds both (the ``prefetch_blocks`` blocks in
  flight hold only weights: an overcount of ``prefetch_blocks`` blocks' gradients, on the safe
  side). No gradient of a streamed block stays on the GPU after its backward;
- with the depth-first schedule over M > 1 micro-batches, the last pass's gradient sums (Note
  [last pass sums on the device] in ``tiermem/stream/grads.py``: HybridAdam, which the plan
  always assumes, is connected, so in the step's last pass each streamed weight's host
  gradient is uploaded beside its block's backward fill and the last micro-batch's gradient
  added there): as many blocks of sums as there are buffers (``prefetch_blocks + 2``: the
  block in backward, the ``prefetch_blocks`` blocks uploaded ahead with their fills, and the
  block before, whose sums' copies back may still read them), each a block's weights' bytes
  (the gradients' dtype is the weights'); the ``"last-pass gradient sums"`` row.
  Block-major passes upload no sums. Their upload, ``S`` more host to device per step, is
  not in the step time's PCIe terms (``h2d_bytes`` counts the weights' fetches only).

The resident set is :func:`tiermem.stream.residency.plan_residency` over blocks costing their
weights + gradients, under the GPU room left after everything else (and, with the sums, after
the sums of the buffers it needs: :func:`resident_blocks`): the longest suffix that fits
(every GPT block has one size, so ``stream_weights(gpu_bytes=...)``, which counts weights
only, takes the same set from :attr:`StreamPlan.stream_gpu_bytes`). The host holds the
streamed weights (pinned RAM, the store's cpu tier; with an NVMe home a RAM host copy *and*
the NVMe copy, plus ``prefetch_blocks + 3`` blocks of RAM staging: Note [streamed RAM
count]), their gradients (one host copy
per streamed weight; twice with the depth-first schedule over several micro-batches, where
phase 1 keeps a pinned staging tensor per weight beside it on CUDA, Note [host gradients]) and
HybridAdam's state of every offloaded parameter (fp32 master + moments): a streamed weight's
optimizer state is never on the GPU (the CPU steps it where it lives), so without an
``offload_fraction`` the plan offloads all of it, and a given one may keep on the GPU only the
state of as many parameters as stay resident.

Per optimizer step of M micro-batches the streamed bytes S (the streamed blocks' weights) cross
PCIe: **block-major** (issue 29 item 4: each block runs for every micro-batch while its weights
are on the GPU; the default, and with M = 1 the same as depth-first) ``2·S − K`` host to
device (forward, and backward with the checkpoint recomputation in the same fetch) and ``S`` of
gradients device to host, once per step, whatever M; **depth-first** (the stream's plain loop)
``M·(2·S − K)`` and ``M·S``. K is the weights of the blocks a forward keeps on the GPU for its
backward (the library's ``ResidencyPlan.kept``, Note [kept into backward] in
``tiermem/stream/residency.py``: the last ``prefetch_blocks + 2`` streamed blocks, fetched once
per pass, not twice). They take no GPU memory beyond the buffers above: the device never holds
more streamed blocks than ``buffer_blocks`` (the stream's ``peak_blocks``), and each buffer is
counted with weights and gradients. Both happen during
forward + backward, beside the GPU's work (Note [optimizer tail]: the floor's first term is the
larger of the GPU's time and this traffic's). A streamed weight's update is not copied back
(HybridAdam writes the host copy the next forward streams), so the optimizer phase's PCIe
counts only the resident parameters. With the weights on NVMe each fetch reads them (``2·S −
K`` per pass) and the update writes them once per step (in the optimizer phase). Block-major over
M > 1 micro-batches (Note [block-major schedule] in ``tiermem/schedule/block_major.py``) saves
only each block's input per micro-batch, all M at once, and recomputes every block in the
backward: its activations are those of checkpointing times M (the inputs the GPU keeps, or
offloads), plus one block's recomputed activations and the M micro-batches' output gradients,
and its GPU time is the checkpointed one (8·N·T), with or without ``checkpoint``.

Note [streamed RAM count]: the plan trains every weight, so a streamed weight is a *trained*
weight, and the library keeps a RAM host copy of each (the tensor HybridAdam writes, Note
[streamed write-back]) whatever its home; a budget is a hard limit, so the plan counts it:

- ``tier="cpu"``: the host copy is the store's pool block: the ``"parameters"`` row's host is
  the streamed weights in whole pages (:func:`block_store_bytes`: each weight tensor takes
  whole 4096-byte pages; exact for the blocks of tiermem's GPT and MoE, else an upper bound).
- ``tier="nvme"``: the host copy is a plain CPU tensor outside the store (exact bytes: the
  row's host), the NVMe copy the row's nvme (in pages), and the reads stage through the
  store's cpu tier: the ``"streaming RAM staging"`` row, ``prefetch_blocks + 3`` blocks (in pages,
  :data:`NVME_STAGING_EXTRA`): up to ``prefetch_blocks + 2`` fills whose reads stay held until
  their copy lands (CUDA) and the one block read further ahead. The store's cpu tier may cache
  more of the NVMe copy when it has room (clean reads, Note [clean reads]), never more than its
  ``cpu_bytes``; the staging row is the room the stream needs. So an NVMe home of trained
  weights saves no RAM (it costs the staging on top): ``stream_tier="auto"`` tries RAM first.
- An NVMe-only home without a host copy (``stream_weights(..., staging_blocks=k)``, Note [NVMe
  home]) holds only *frozen* weights (a LoRA base, ``examples/train_lora.py``): the plan has no
  frozen-base mode (it plans full training), so it never plans that home; its RAM is
  ``staging_blocks`` blocks (default ``prefetch_blocks + 2``: :func:`tiermem.stream.nvme_home.
  staging_bytes`).

tests/test_plan_stream_ram.py counts the host copies and the store's staging of a real stream
against these rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tiermem import options
from tiermem.names import check_choice
from tiermem.apps.plan.result import Item
from tiermem.shapes import GiB
from tiermem.store.pool import ALIGN_BYTES, block_bytes
from tiermem.stream.residency import ResidencyPlan, plan_residency

STREAM_CHOICES = (False, True, "auto")
"""``plan(stream_weights=...)``: off, on, or only when the resident plan overflows the GPU."""
STREAM_TIERS = ("auto", "cpu", "nvme")
"""``plan(stream_tier=...)``: the streamed weights' home (auto: RAM, else NVMe)."""
STREAM_SCHEDULES = ("auto", "block-major", "depth-first")
"""``plan(stream_schedule=...)``: auto is block-major (with one micro-batch the same as
depth-first)."""
NVME_STAGING_EXTRA = 3
"""Blocks of RAM staging an NVMe home of *trained* weights needs beyond ``prefetch_blocks``
(Note [streamed RAM count]): the ``prefetch_blocks + 2`` fills whose reads are held until their
copy lands and the one block the stream reads further ahead (``WeightStream._prefetch``)."""


def block_numels(*, d_model: int, mlp_ratio: int, n_experts: int | None = None,
                 d_expert: int | None = None) -> list[int]:
    """Elements of each weight tensor of one block of ``tiermem.models.GPT`` (LN1, QKV, proj,
    LN2, fc, out: each weight + bias) or, with ``n_experts``, of ``tiermem.models.moe.MoE``
    (LN1, QKV weight, proj, LN2, router weight, each expert's fc and out).

    Raises:
        nothing: arithmetic on ints.
    """
    d = d_model
    if n_experts:
        expert = [d_expert * d, d_expert, d * d_expert, d]
        return [d, d, 3 * d * d, d * d, d, d, d, n_experts * d] + expert * n_experts
    h = mlp_ratio * d
    return [d, d, 3 * d * d, 3 * d, d * d, d, d, d, h * d, h, d * h, d]


def block_store_bytes(block_params: int, param_bytes: int, numels: list[int]) -> int:
    """The store bytes of one block's weights: the pool and the spill space give each weight
    tensor whole ``ALIGN_BYTES`` pages (Note [streamed RAM count]). Exact when ``numels`` (the
    model's block, :func:`block_numels`) has ``block_params`` elements; else (a ``num_params``
    of another model) an upper bound: one more page per tensor.

    Raises:
        nothing: arithmetic on ints.
    """
    if sum(numels) == block_params:
        return sum(block_bytes(n * param_bytes) for n in numels)
    return block_params * param_bytes + len(numels) * ALIGN_BYTES


@dataclass
class StreamPlan:
    """What the plan decided for the streamed weights (Note [streaming plan]). Bytes.

    Attributes:
        n_blocks: the model's blocks.
        resident: indices of the blocks kept on the GPU (a suffix).
        streamed: indices of the streamed blocks.
        block_params: parameters of one block.
        block_bytes: one block's weights (``block_params`` x parameter bytes).
        streamed_params, streamed_bytes: of all streamed blocks' weights (S).
        prefetch_blocks: blocks fetched ahead.
        buffer_blocks: streamed blocks on the GPU at once (``prefetch_blocks + 2``, at most
            the streamed ones).
        buffer_bytes: the GPU buffers: ``buffer_blocks`` x (weights + gradients) of a block.
        sum_bytes: the GPU bytes of the last pass's gradient sums (depth-first over M > 1
            micro-batches: ``buffer_blocks`` x a block's weights; else 0: Note [streaming
            plan]).
        stream_gpu_bytes: ``stream_weights(gpu_bytes=...)``: the resident blocks' and the
            buffers' weights (what the stream counts).
        tier: the streamed weights' home, ``"cpu"`` (pinned RAM) or ``"nvme"``.
        schedule: ``"block-major"`` or ``"depth-first"``.
        micro_batches: per optimizer step (M).
        passes: passes (forward + backward) each streamed block runs per step: 1 block-major,
            M depth-first.
        kept: the streamed blocks a forward keeps on the GPU for its backward (the library's
            ``ResidencyPlan.kept``, Note [kept into backward]).
        kept_bytes: their weights (K).
        h2d_bytes: streamed weights host to device per step (``passes x (2 x S - K)``).
        d2h_bytes: their gradients device to host per step (``passes x S``).
    """

    n_blocks: int
    resident: tuple[int, ...]
    streamed: tuple[int, ...]
    block_params: int
    block_bytes: int
    streamed_params: int
    streamed_bytes: int
    prefetch_blocks: int
    buffer_blocks: int
    buffer_bytes: int
    stream_gpu_bytes: int
    tier: str
    schedule: str
    micro_batches: int
    passes: int
    kept: tuple[int, ...]
    kept_bytes: int
    h2d_bytes: int
    d2h_bytes: int
    sum_bytes: int = 0


def check_stream_args(stream_weights, stream_tier, stream_schedule, prefetch_blocks, *,
                      gpu_step_fraction: float, breadth_first_blocks) -> None:
    """Refuse bad streaming arguments of :func:`tiermem.apps.plan.plan` (one line each).

    Raises:
        ValueError: an unknown choice; with ``stream_weights=True``, a GPU lane or
            breadth-first blocks (not planned with streamed weights; ``"auto"`` then keeps
            every weight on the GPU).
        TypeError, ValueError: ``prefetch_blocks`` not an int >= 0.
    """
    who = "plan: "
    check_choice(who, "stream_weights", stream_weights, STREAM_CHOICES,
                 "True streams blocks, 'auto' only when the GPU cannot hold every weight "
                 "(command line: --stream-weights on|off|auto)")
    check_choice(who, "stream_tier", stream_tier, STREAM_TIERS,
                 "the streamed weights' home: pinned RAM, NVMe, or auto (RAM if it fits)")
    check_choice(who, "stream_schedule", stream_schedule, STREAM_SCHEDULES,
                 "auto: block-major (with one micro-batch the same as depth-first)")
    # Note [one definition] in tiermem/options.py: the streaming section's checks; "auto" is
    # the planner's choice (the choices above name it)
    for keyword, dotted, value in (("stream_weights", "streaming.enabled", stream_weights),
                                   ("stream_tier", "streaming.tier", stream_tier),
                                   ("stream_schedule", "streaming.schedule", stream_schedule),
                                   ("prefetch_blocks", "streaming.prefetch_blocks",
                                    prefetch_blocks)):
        if value != "auto":
            options.check(dotted, options.Who(who), value, "plan", keyword)
    if stream_weights is not True:  # "auto" does not stream with these (plan() says so)
        return
    if gpu_step_fraction:
        raise ValueError(f"plan: gpu_step_fraction={gpu_step_fraction:g} with stream_weights="
                         f"{stream_weights!r}: the GPU lane is not planned with streamed "
                         f"weights; give gpu_step_fraction=0 or stream_weights=False")
    # breadth_first_blocks "auto" is left at 0 when streaming
    if breadth_first_blocks not in (0, "auto"):
        raise ValueError(f"plan: breadth_first_blocks={breadth_first_blocks!r} with "
                         f"stream_weights={stream_weights!r}: streaming plans the block-major "
                         f"schedule instead (every block for every micro-batch); give 0")


def schedule_for(stream_schedule: str, micro_batches: int) -> str:
    """The schedule a plan times: ``"block-major"`` for ``"auto"`` (with one micro-batch the
    two schedules are one: each block fetched once per pass; timing it as block-major keeps
    the traffic fixed per step as ``step_time`` scales the micro-batches).

    Raises:
        nothing: a choice :func:`check_stream_args` checked.
    """
    return "block-major" if stream_schedule == "auto" else stream_schedule


def non_block_params(*, vocab: int, seq: int, d_model: int) -> int:
    """Parameters of ``tiermem.models.GPT`` (and ``MoE``) outside its blocks: token and
    position embeddings, the final LayerNorm, the untied head.

    Raises:
        nothing: arithmetic on ints.
    """
    return 2 * vocab * d_model + seq * d_model + 2 * d_model


def resident_blocks(n_layers: int, per_block: int, *, room: int, prefetch_blocks: int,
                    sum_bytes: int) -> ResidencyPlan:
    """The longest resident suffix of ``n_layers`` blocks of ``per_block`` bytes whose cost,
    :func:`plan_residency`'s (resident blocks + buffers) plus ``sum_bytes`` per buffer (the
    last pass's gradient sums, Note [streaming plan]), fits ``room``; every block streamed
    (and overflowing) when not even the buffers fit. With ``sum_bytes`` 0, ``plan_residency``'s
    own choice.

    The buffers a plan needs depend on the blocks it streams, so each count of buffers the
    sums may be paid for (0 to ``prefetch_blocks + 2``) is tried: a plan whose buffers are at
    most that count fits with its sums, and the optimum is found at its own count (a longer
    suffix under the same room never needs more buffers).

    Raises:
        nothing: arithmetic on checked values.
    """
    sizes = [per_block] * n_layers
    best = None
    for paid in range(min(prefetch_blocks + 2, n_layers) + 1 if sum_bytes else 1):
        try:
            res = plan_residency(sizes, gpu_bytes=max(0, room - paid * sum_bytes),
                                 prefetch_blocks=prefetch_blocks)
        except ValueError:  # not even the buffers fit under this room
            continue
        if res.buffer_blocks <= paid or not sum_bytes:
            if best is None or len(res.resident) > len(best.resident):
                best = res
    if best is None:  # stream every block (and overflow)
        best = plan_residency(sizes, gpu_bytes=None, prefetch_blocks=prefetch_blocks)
    return best


def place_stream(items: list[Item], *, cap_gpu: int, n_layers: int, block_params: int,
                 param_bytes: int, prefetch_blocks: int, tier: str, schedule: str,
                 micro_batches: int, gpu_state_params: int,
                 block_pages: int | None = None,
                 block_grads_pinned: int | None = None) -> tuple[StreamPlan, str | None]:
    """Stream the blocks' weights in a placement (Note [streaming plan]): move the streamed
    blocks' weights and gradients off the GPU rows of ``items`` (named ``"parameters"`` and
    ``"gradients"``, sized for every weight on the GPU) into the home ``tier`` and pinned RAM,
    add the buffers (and the NVMe staging), and choose the resident blocks so the GPU total
    fits ``cap_gpu`` if it can.

    Args:
        items: the placement's rows, every other GPU row already final; changed in place.
        cap_gpu: the GPU's bytes.
        n_layers: blocks; block_params: parameters of one block; param_bytes: per parameter.
        prefetch_blocks, tier, schedule, micro_batches: the stream's (``tier`` ``"cpu"`` or
            ``"nvme"``, ``schedule`` ``"block-major"`` or ``"depth-first"``).
        gpu_state_params: parameters whose optimizer state stays on the GPU; only resident
            ones may.
        block_pages: one block's weights in the store, in whole pages
            (:func:`block_store_bytes`); None: the weights' bytes.
        block_grads_pinned: one block's host gradients as torch pins them, one tensor per
            weight (Note [pinned rounding] in tiermem/apps/plan/pinned.py); None: the bytes.

    Returns:
        ``(StreamPlan, problem)``: ``problem`` a reason the placement cannot work besides
        its capacities (GPU-side optimizer state of more parameters than stay resident), or
        None.

    Raises:
        nothing: arithmetic on checked values.
    """
    rows = {i.name: i for i in items}
    params, grads = rows["parameters"], rows["gradients"]
    all_params = (params.gpu + params.host + params.nvme) // param_bytes  # all on the GPU yet
    w = block_params * param_bytes
    pages = w if block_pages is None else block_pages  # Note [streamed RAM count]
    per_block = 2 * w  # weights + gradients: what a resident block or a buffer holds
    others = sum(i.gpu for i in items) - 2 * n_layers * w  # all but the blocks' weights+grads
    # the last pass's gradient sums, a block's weights per buffer: Note [streaming plan]
    sum_per_buffer = w if schedule == "depth-first" and micro_batches > 1 else 0
    res = resident_blocks(n_layers, per_block, room=cap_gpu - others,
                          prefetch_blocks=prefetch_blocks, sum_bytes=sum_per_buffer)
    n_streamed = len(res.streamed)
    s_params = n_streamed * block_params
    s_bytes = s_params * param_bytes
    passes = 1 if schedule == "block-major" else micro_batches
    kept_bytes = len(res.kept) * w  # Note [kept into backward]: fetched once per pass
    stream = StreamPlan(
        n_blocks=n_layers, resident=res.resident, streamed=res.streamed,
        block_params=block_params, block_bytes=w, streamed_params=s_params,
        streamed_bytes=s_bytes, prefetch_blocks=prefetch_blocks,
        buffer_blocks=res.buffer_blocks, buffer_bytes=res.buffer_bytes,
        stream_gpu_bytes=(len(res.resident) + res.buffer_blocks) * w, tier=tier,
        schedule=schedule, micro_batches=micro_batches, passes=passes, kept=res.kept,
        kept_bytes=kept_bytes, h2d_bytes=passes * (2 * s_bytes - kept_bytes),
        d2h_bytes=passes * s_bytes, sum_bytes=res.buffer_blocks * sum_per_buffer)
    home = "RAM" if tier == "cpu" else "NVMe"
    params.gpu -= s_bytes
    # Note [streamed RAM count]: a trained weight keeps a RAM host copy at either home
    params.host = n_streamed * pages if tier == "cpu" else s_bytes
    params.nvme = n_streamed * pages if tier == "nvme" else 0
    grads.gpu -= s_bytes
    copies = 2 if schedule == "depth-first" and micro_batches > 1 else 1
    # Note [pinned rounding]: each host gradient (and staging tensor) pinned on its own
    grads.host = copies * n_streamed * (w if block_grads_pinned is None else block_grads_pinned)
    if n_streamed:
        params.note += (f"; {n_streamed} of {n_layers} blocks streamed from {home}, "
                        f"{len(res.resident)} resident")
        grads.note += ("; streamed blocks' on the host" + (
            " (+ phase 1's pinned staging: depth-first)" if copies == 2 else ""))
        items.insert(items.index(grads) + 1, Item(
            "streaming buffers", gpu=res.buffer_bytes,
            note=f"{res.buffer_blocks} x {per_block / GiB:.2f} GiB (prefetch {prefetch_blocks}"
                 f" + 2 blocks' weights + grads)"))
        if stream.sum_bytes:
            items.insert(items.index(grads) + 2, Item(
                "last-pass gradient sums", gpu=stream.sum_bytes,
                note=f"{res.buffer_blocks} x {w / GiB:.2f} GiB (depth-first over "
                     f"{micro_batches} micro-batches: the last one added on the GPU)"))
        if tier == "nvme":
            staged = min(prefetch_blocks + NVME_STAGING_EXTRA, n_streamed)
            items.insert(items.index(grads) + 2 + bool(stream.sum_bytes), Item(
                "streaming RAM staging", host=staged * pages,
                note=f"{staged} blocks in the store's RAM: the NVMe copy's reads (prefetch "
                     f"{prefetch_blocks} + {NVME_STAGING_EXTRA}); the RAM host copy is in "
                     f"'parameters'"))
    resident_params = rows["parameters"].gpu // param_bytes
    problem = None
    if gpu_state_params > resident_params:
        problem = (f"optimizer state of {gpu_state_params / 1e9:.2f}B params kept on the GPU, but "
                   f"only {resident_params / 1e9:.2f}B params stay resident (a streamed weight "
                   f"is stepped on the host): raise offload_fraction to at least "
                   f"{least_fraction(resident_params, all_params):.2f}, or "
                   f"leave it to the plan (None / --offload-fraction auto)")
    return stream, problem


def least_fraction(resident_params: int, num_params: int) -> float:
    """The least offload fraction that leaves GPU-side state for at most ``resident_params``
    of ``num_params``, rounded up to 0.01 like the plan's fractions."""
    return min(1.0, math.ceil((1 - resident_params / max(1, num_params)) * 100 - 1e-9) / 100)


def gpu_breakdown(items: list[Item]) -> str:
    """``"parameters 1.3 GiB + ... + reserve 2.2 GiB"``: the GPU rows of a placement, for a
    refusal that names what does not fit.

    Raises:
        nothing: formatting.
    """
    return " + ".join(f"{i.name} {i.gpu / GiB:,.1f} GiB" for i in items if i.gpu)
