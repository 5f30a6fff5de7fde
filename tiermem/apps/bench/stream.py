"""``tiermem bench stream``: training-step time of the reference GPT with every block's weights
streamed (:func:`tiermem.stream.stream_weights`) against the same model resident, in ONE
process, each row with its parity column (issue 29; docs/streaming.md).

Rows (same model, same initial weights, same batches, a new batch every step; the optimizer
steps every step, so a stale or wrong streamed weight changes the losses):

- ``resident, AdamW``: torch.optim.AdamW on the device (the baseline), and once more (its
  run-to-run noise, :mod:`tiermem.apps.bench.parity`);
- ``resident, AdamW on host copies``: the blocks' weights stepped by the same AdamW on host
  copies (gradients copied down, weights copied up): the arithmetic of the streamed row, its
  parity reference (against the baseline its kernel is the CPU's: ``differs: host AdamW`` when
  outside the noise);
- ``streamed, AdamW``: every block streamed from the store's ``--tier``, AdamW stepping the host
  copies (docs/streaming.md's phase-1 loop);
- ``resident, HybridAdam`` / ``streamed, HybridAdam``: HybridAdam with all state offloaded
  (``offload_fraction=1``), without and with the stream (Note [streamed write-back] in
  tiermem/optim/streamed.py); the streamed row's reference is the resident one.

Every row uses :data:`tiermem.apps.bench.optim_base.HP`. Clipping (``--max-grad-norm``, default
``off,1.0``: what users run, clipping on, and off beside it): every row runs once per threshold
(``clip`` column), each threshold a block of its own with its own baseline and noise run, and a
clipped row's parity is judged against its reference clipped alike, never against an unclipped
run (Note [bench clip rows] in tiermem/apps/bench/optim.py). The torch AdamW rows clip as users
do, ``torch.nn.utils.clip_grad_norm_(model.parameters(), v)`` between backward and the step
(streamed: the blocks' host copies and gradients, docs/streaming.md); the HybridAdam rows with
``HybridAdam(max_grad_norm=v, rollback_bytes=--rollback-bytes)``: its own clip, speculating
within that budget (``--rollback-bytes``, bench optim's flag and default; 0: the step waits for
the norm; Note [speculative step], over streamed weights Note [streamed rollback]).

``step ms`` is the median over ``--repeats`` runs of each run's median timed step (forward +
backward + optimizer step, the device synchronised), with the spread (min-max of the run
medians); ``fwd+bwd ms`` the same for forward + backward alone; ``x`` the step time over the
baseline's at the same clip; ``vs off`` over the same setup's unclipped row; ``spec/rb`` (a
clipping HybridAdam row) its speculated / rolled-back chunks over the last run's timed steps,
as ``tiermem bench optim`` counts them; ``streamed GiB`` the weight bytes the stream copied to
the device per step; ``PCIe floor ms`` those bytes at the H2D rate measured here (a pinned
``--probe-bytes`` copy, median of 5): the least time the stream can take; ``parity`` the
verdict of the row's losses (every step, and one more batch after the last) against its
reference (named; at the row's clip), within 4x the noise of the baseline at that clip, and for
a streamed row also against the baseline itself (its reference's precision trade named when
outside the noise). A streamed row whose losses are not its reference's is ``WRONG`` and the
command exits 1: a fast wrong row cannot pass. Below the table, one line per optimizer and
clip: the streamed row's step and fwd+bwd times over the resident row's with the same
optimizer at the same clip (issue 29's 1.15x / 1.05x targets). Each run's line ends with
where the time went: a HybridAdam row's last step (:func:`worker_diagnosis`), a streamed row's
hand-offs and adds, and over the timed steps each micro-batch's fwd+bwd of a depth-first row
(``pass_ms``, Note [pass clock]) and a streamed row's gradient adder per step (Note [adder
seconds] in tiermem/stream/grad_adds.py).

``--gpu SIZE`` caps this process's CUDA memory (``torch.cuda.set_per_process_memory_fraction``,
the name and meaning of ``tiermem plan --gpu``). ``--micro-batches M`` runs M micro-batches per
step (the streamed rows block-major with ``--schedule block-major``: each block crosses PCIe
once per pass). Without CUDA the defaults are a CPU-sized model (smoke runs).

Note [bench stream schedule]: with one micro-batch per step the block-major schedule moves the
same bytes as depth-first (each block filled once per pass, twice per step) and adds a forward
of every block, its recomputation (Note [block-major schedule]), which the resident rows do not
run. Session 13's H200 rows at 16k tokens ran so (its log's header: ``micro_batches=1
schedule=block-major``): fwd+bwd 320 ms streamed vs 241 resident, a gap of about one forward
(a third of 241), which needs no PCIe stall to explain (not yet re-measured). So ``--schedule
auto`` (the default) streams depth-first with one micro-batch and block-major with more;
``--schedule block-major`` still forces it.

Usage::

    tiermem bench stream --gpu 64GiB                  # reference GPT, 16k tokens per step
    tiermem bench stream --micro-batches 4 --gpu 64GiB  # 64k tokens per step, block-major
    tiermem bench stream --max-grad-norm off --gpu 64GiB  # unclipped rows only (half the time)
    tiermem bench stream --layers 2 --d-model 32 --heads 2 --seq 16 --batch 2 --vocab 64
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from tiermem import flags
from tiermem.apps import table
from tiermem.gpu_cap import cap_gpu, uncap_gpu
from tiermem.apps.bench.common import (bench_device, bench_main, learnable_batches, parse_clips,
                                        sync)
from tiermem.apps.bench.optim_base import HP
from tiermem.apps.bench.parity import noise_of, verdict, worst_verdict
from tiermem.config import StoreConfig, parse_bytes
from tiermem.models.gpt import GPT, GPTConfig
from tiermem.names import gib
from tiermem.schedule.micro_batches import forward_backward
from tiermem.store import TierStore
from tiermem.stream import stream_weights

BASELINE = "resident, AdamW"
AGAIN = "resident, AdamW (again: its noise)"
HOST_REF = "resident, AdamW on host copies"
STREAMED = "streamed, AdamW"
HYBRID_REF = "resident, HybridAdam"
HYBRID_STREAMED = "streamed, HybridAdam"


@dataclass
class Setup:
    """One row to run: its name, whether the blocks are streamed, the optimizer factory
    ``make_opt(model)``, the row its losses are checked against (None: the baseline), the
    ``max_grad_norm`` it trains with (``clip``, None: none) and whether its optimizer clips
    (HybridAdam's ``max_grad_norm``) or the loop does (``clip_grad_norm_``, torch AdamW)."""

    name: str
    streamed: bool
    make_opt: Callable
    reference: str | None
    trade: str | None = None
    clip: float | None = None
    clips_itself: bool = False


@dataclass
class Row:
    """One setup's result at one ``clip`` (the ``--max-grad-norm`` entry as written: ``off`` or
    a threshold) (times in ms, bytes per step; ``vs_off``: ``step_ms`` over the same setup's
    unclipped row; ``spec``: speculated, rolled-back chunks of a clipping HybridAdam row)."""

    setup: str
    step_ms: float
    spread_ms: tuple[float, float]
    fwd_bwd_ms: float
    tokens_per_s: float
    streamed_bytes: int | None = None
    pcie_floor_ms: float | None = None
    parity: str = ""
    losses: list[float] = field(default_factory=list)
    clip: str = "off"
    vs_off: float | None = None
    spec: tuple[int, int] | None = None


class HostAdamW:
    """AdamW stepping the blocks' weights on host copies (gradients copied to the host, the
    new weights copied back) and the other parameters where they are: the arithmetic of
    AdamW over a streamed model, without a stream (the streamed row's reference)."""

    def __init__(self, model: GPT) -> None:
        block_ids = {id(p) for p in model.blocks.parameters()}
        self.pairs = [(p, p.detach().to("cpu", copy=True)) for p in model.parameters()
                      if id(p) in block_ids]
        rest = [p for p in model.parameters() if id(p) not in block_ids]
        self.opt = torch.optim.AdamW([h for _, h in self.pairs] + rest, **HP)

    def step(self) -> None:
        for p, h in self.pairs:
            h.grad = p.grad.to("cpu")
        self.opt.step()
        with torch.no_grad():
            for p, h in self.pairs:
                p.copy_(h)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)
        for p, _ in self.pairs:
            p.grad = None


def _parse_args(argv):
    big = torch.cuda.is_available()  # the reference GPT on a GPU; a CPU-sized model otherwise
    p = argparse.ArgumentParser(prog="tiermem bench stream", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layers", type=int, default=24 if big else 4, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=2048 if big else 64, help="model width")
    p.add_argument("--heads", type=int, default=16 if big else 4, help="attention heads")
    p.add_argument("--seq", type=int, default=2048 if big else 32, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8 if big else 2,
                   help="sequences per micro-batch (8 x 2048: 16k tokens)")
    add = functools.partial(flags.add, p, "bench stream")  # the fields: tiermem/flags.py
    add("--grad-accumulation-steps", dest="micro_batches", type=int, default=1,
        help="micro-batches per step")
    p.add_argument("--vocab", type=int, default=32000 if big else 128, help="vocabulary size")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per run")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of every setup; ms is the median of the runs' medians")
    add("--stream-tier", dest="tier", choices=("cpu", "nvme"), default="cpu",
        help="the streamed weights' home (nvme: needs --nvme-dir)")
    p.add_argument("--nvme-dir", default=None, help="spill directory for --stream-tier nvme")
    p.add_argument("--prefetch-blocks", type=int, default=1, help="blocks fetched ahead")
    add("--stream-schedule", dest="schedule", choices=("auto", "block-major", "depth-first"),
        default="auto", help="streamed rows' schedule over the micro-batches (auto: "
        "block-major with 2 or more, Note [bench stream schedule])")
    p.add_argument("--checkpoint", action="store_true", help="checkpoint every block (all rows)")
    add("--gpu-bytes", dest="gpu", default=None, metavar="SIZE",
        help="cap CUDA memory at SIZE (as tiermem plan --gpu-bytes); default: no cap")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="parameter dtype (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--optimizers", default="adamw,hybrid",
                   help="comma-separated: adamw (torch AdamW rows), hybrid (HybridAdam rows)")
    p.add_argument("--probe-bytes", default="256MiB" if big else "4MiB",
                   help="bytes of the pinned H2D copy that measures the PCIe rate")
    add("--max-grad-norm", default="off,1.0",
        help="max_grad_norm thresholds, comma-separated, 'off' for none: every row runs at "
             "each (Note [bench clip rows])")
    add("--rollback-bytes", default="4GiB",
        help="HybridAdam rollback_bytes of the clipping HybridAdam rows, which speculate "
             "within it (bytes or '4GiB'; 0: they wait for the norm)")
    args = p.parse_args(argv)
    for name in ("layers", "d_model", "heads", "seq", "batch", "micro_batches", "vocab",
                 "steps", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    for name in ("warmup", "prefetch_blocks"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 0")
    if args.tier == "nvme" and not args.nvme_dir:
        raise ValueError("--tier nvme needs --nvme-dir (a directory on the NVMe drive)")
    wanted = {x.strip() for x in args.optimizers.split(",") if x.strip()}
    if not wanted or wanted - {"adamw", "hybrid"}:
        raise ValueError(f"--optimizers={args.optimizers!r}: give adamw, hybrid or both "
                         f"(comma-separated)")
    args.optimizer_set = wanted
    if args.schedule == "auto":  # Note [bench stream schedule]
        args.schedule = "block-major" if args.micro_batches > 1 else "depth-first"
    args.gpu_bytes = None if args.gpu is None else parse_bytes(args.gpu, "--gpu")
    args.probe = parse_bytes(args.probe_bytes, "--probe-bytes")
    args.clips = parse_clips(args.max_grad_norm, example="off,1.0")
    args.rollback = parse_bytes(args.rollback_bytes, "--rollback-bytes")
    return args


def h2d_bytes_per_s(nbytes: int, device: torch.device) -> float:
    """The host-to-device copy rate (bytes/s) of ``nbytes`` from pinned memory (pageable on a
    machine without CUDA, where it is a memcpy): median of 5 timed copies after one."""
    cuda = device.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for i in range(6):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def _setups(args, store: TierStore, clip: float | None = None) -> list[Setup]:
    """The rows to run at ``max_grad_norm`` ``clip`` (None: no clipping), in order (each
    reference before the rows checked against it)."""
    def adamw(model):
        return torch.optim.AdamW(model.parameters(), **HP)

    def hybrid(model):
        from tiermem.optim import HybridAdam  # noqa: PLC0415
        return HybridAdam(model.parameters(), **HP, offload_fraction=1.0, store=store,
                          grad_accumulation_steps=args.micro_batches, max_grad_norm=clip,
                          rollback_bytes=args.rollback if clip is not None else 0)

    at = dict(clip=clip)
    rows = [Setup(BASELINE, False, adamw, None, **at), Setup(AGAIN, False, adamw, BASELINE, **at)]
    if "adamw" in args.optimizer_set:
        rows += [Setup(HOST_REF, False, HostAdamW, BASELINE, trade="host AdamW", **at),
                 Setup(STREAMED, True, adamw, HOST_REF, **at)]
    if "hybrid" in args.optimizer_set:
        at["clips_itself"] = True
        rows += [Setup(HYBRID_REF, False, hybrid, BASELINE, trade="HybridAdam's fp32 masters",
                       **at),
                 Setup(HYBRID_STREAMED, True, hybrid, HYBRID_REF, **at)]
    return rows


def make_stream(model: GPT, store: TierStore, args):
    """The weight stream of every block (a function of its own: tests replace it)."""
    return stream_weights(model.blocks, store=store, tier=args.tier,
                          prefetch_blocks=args.prefetch_blocks)


class PassClock:
    """Note [pass clock]: the time of each micro-batch's forward + backward in a depth-first
    step (``pass_ms``), from a mark at each micro-batch's ``model.embed`` (a pass begins there;
    forward_backward calls it once per micro-batch, after the previous backward returned) and
    one after the step's forward_backward returned. On CUDA a mark is an event recorded on the
    current stream (no host sync: the events are read after the step's own sync), so a pass's
    time is GPU time between its first kernel's launch point and the next pass's, including any
    GPU idle while the host waits at the pass end (Note [adder seconds]); on the CPU it is
    ``time.perf_counter``. Marks are taken only while armed (:meth:`start`), not by the final
    no-grad batch.

    Args:
        model: the GPT whose ``embed`` is wrapped (an attribute of this instance only).
        device: the compute device.
    """

    def __init__(self, model: GPT, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.armed = False
        embed = model.embed

        def marked(idx: torch.Tensor) -> torch.Tensor:
            if self.armed:
                self.mark()
            return embed(idx)
        model.embed = marked

    def start(self) -> None:
        """Arm the clock for one step (its earlier marks dropped)."""
        self.marks, self.armed = [], True

    def mark(self) -> None:
        """A pass boundary (call once more after forward_backward returned)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()  # a pass boundary on the compute stream: read after the step's sync
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def pass_ms(self) -> list[float]:
        """Each pass's ms (call after the device was synchronised); disarms the clock.

        Raises:
            RuntimeError: a CUDA event not yet recorded (the device was not synchronised).
        """
        self.armed = False
        m = self.marks
        if self.cuda:
            return [a.elapsed_time(b) for a, b in zip(m, m[1:])]
        return [1e3 * (b - a) for a, b in zip(m, m[1:])]


ADDER_STATS = ("adder_busy_s", "adder_copy_wait_s", "add_wait_s", "end_wait_s", "added_bytes")
"""The stream's adder counts a run line prints per timed step (Note [adder seconds])."""


def timed_diagnosis(pass_ms: list[list[float]], adder: dict, steps: int) -> str:
    """``pass_ms a/b/..`` (each pass's median over the timed steps: Note [pass clock]) and the
    adder's seconds per timed step (Note [adder seconds]) with ``added_mib`` and the add rate
    ``add_gb_s`` (bytes added over the adder's busy seconds); "" when there is neither.

    Raises:
        Nothing.
    """
    parts = []
    if pass_ms:
        per = [statistics.median(p[k] for p in pass_ms) for k in range(len(pass_ms[0]))]
        parts.append("pass_ms " + "/".join(f"{v:.1f}" for v in per))
    if adder and steps:
        parts += [f"{k} {adder[k] / steps:.3f}" for k in ADDER_STATS[:-1]]
        parts.append(f"added_mib {adder['added_bytes'] / steps / 2**20:.3f}")
        busy = adder["adder_busy_s"]
        parts.append(f"add_gb_s {adder['added_bytes'] / busy / 1e9:.1f}" if busy > 0
                     else "add_gb_s -")
    return ", ".join(parts)


def _train(setup: Setup, build: Callable[[], GPT], init: dict, batches, store, args, device):
    """One run of ``setup`` on a fresh ``build()`` model loaded from ``init`` (no hook of an
    earlier run stays), clipping at ``setup.clip`` as its optimizer's users do (torch AdamW:
    ``clip_grad_norm_`` in the timed step; HybridAdam: its ``max_grad_norm``): (timed fwd+bwd
    seconds, timed step seconds, losses, streamed bytes per timed step or None, the last step's
    diagnosis, (speculated, rolled-back) chunks over the timed steps of a clipping HybridAdam
    or None)."""
    model = build()
    with torch.no_grad():
        model.load_state_dict(init)
    stream = make_stream(model, store, args) if setup.streamed else None
    opt = setup.make_opt(model)
    block_major = stream is not None and args.schedule == "block-major"
    fb_s, step_s, losses, streamed = [], [], [], 0
    spec = [0, 0] if setup.clip is not None and setup.clips_itself else None
    # Note [pass clock]: depth-first steps of several micro-batches, resident rows too
    clock = PassClock(model, device) if len(batches[0]) > 1 and not block_major else None
    pass_ms: list[list[float]] = []
    adder = dict.fromkeys(ADDER_STATS, 0) if stream is not None else {}
    try:
        for step, micro in enumerate(batches[:-1]):
            before = stream.stats()["h2d_bytes"] if stream is not None else 0
            added = {k: stream.stats()[k] for k in ADDER_STATS} if stream is not None else {}
            sync(device)
            t0 = time.perf_counter()
            if clock is not None:
                clock.start()
            out = forward_backward(model, micro, block_major=block_major)
            if clock is not None:
                clock.mark()  # the last pass's end
            sync(device)
            t1 = time.perf_counter()
            if setup.clip is not None and not setup.clips_itself:  # as users clip
                torch.nn.utils.clip_grad_norm_(model.parameters(), setup.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if hasattr(opt, "synchronize"):
                opt.synchronize()  # HybridAdam: the step's CPU side is done
            sync(device)
            t2 = time.perf_counter()
            losses.append(sum(float(x) for x in out) / len(out))
            if clock is not None:
                passes = clock.pass_ms()  # the events landed: the device was synchronised
            if step >= args.warmup:
                fb_s.append(t1 - t0)
                step_s.append(t2 - t0)
                if clock is not None:
                    pass_ms.append(passes)
                if stream is not None:
                    st = stream.stats()
                    streamed += st["h2d_bytes"] - before
                    for k in ADDER_STATS:  # Note [adder seconds]
                        adder[k] += st[k] - added[k]
                if spec is not None:  # as tiermem bench optim counts them
                    st = opt.step_stats()
                    spec[0] += st.get("speculated_chunks", 0)
                    spec[1] += st.get("rolled_back_chunks", 0)
        diag = _diagnosis(opt, stream)  # the last step's (Note [hand-off lag])
        timed = timed_diagnosis(pass_ms, adder, len(step_s))
        if timed:  # medians / means over the timed steps: Note [pass clock]
            diag += ("; " if diag else "") + f"timed steps: {timed}"
        with torch.no_grad():  # the final weights, seen through one more batch
            losses.append(float(model(*batches[-1][0])[1]))
    finally:
        if hasattr(opt, "close"):
            opt.close()
        if stream is not None:
            stream.close(force=True)
    per_step = streamed // max(1, len(step_s)) if stream is not None else None
    return fb_s, step_s, losses, per_step, diag, None if spec is None else tuple(spec)


WORKER_STATS = ("step_s", "stall_s", "worker_s", "cpu_adam_s", "copy_wait_s", "clip_wait_s",
                "grad_copy_s", "state_s", "write_back_s")
"""HybridAdam's ``step_stats`` seconds a row's diagnosis prints: the step, its wait for the
worker, and the worker's phases (Note [worker phases] in tiermem/optim/chunk_worker.py)."""


def worker_diagnosis(st: dict) -> list[str]:
    """``"name value"`` for each of HybridAdam's ``step_stats`` ``st`` in :data:`WORKER_STATS`,
    then the MiB of streamed gradients stepped in place / copied through the ring (Note
    [in-place host chunks]) and whether the step speculated, its speculated and rolled-back
    chunks (Note [speculative step]), the streamed gradient norms taken before / in
    ``step()`` (Note [streamed gradient norms]).

    Raises:
        Nothing.
    """
    parts = [f"{k} {st[k]:.3f}" for k in WORKER_STATS if k in st]
    parts += [f"{k.removesuffix('_bytes')}_mib {st[k] / 2**20:.1f}"
              for k in ("in_place_bytes", "ring_copy_bytes") if k in st]
    return parts + [f"{k} {st[k]}" for k in ("speculating", "speculated_chunks",
                                             "rolled_back_chunks", "norms_precomputed",
                                             "norms_computed") if k in st]


def _diagnosis(opt, stream) -> str:
    """Where a row's optimizer tail goes (Note [hand-off lag] in tiermem/stream/grads.py):
    HybridAdam's last step (``step_stats``: :func:`worker_diagnosis`) and the gradients the
    stream handed over during the passes / at their end and its host adds on the adder thread
    / waited for (Note [gradient adder]) and summed on the device (Note [last pass sums on the
    device]; totals since the stream began); "" for a row with
    neither."""
    parts = []
    if hasattr(opt, "step_stats"):
        parts += worker_diagnosis(opt.step_stats())
    if stream is not None:
        st = stream.stats()
        parts += [f"{k} {st[k]}" for k in ("handed_in_pass", "handed_at_end",
                                              "adds_off_thread", "add_waits", "device_sums")]
    return ", ".join(parts)


def seeded_model(args, device: torch.device):
    """The reference GPT of ``args`` on ``device`` (``args.dtype``, else bf16 on CUDA and fp32
    on the CPU), built after ``torch.manual_seed(0)``.

    Returns:
        ``(config, dtype, build, model, init)``: ``build()`` makes another model of that
        structure (untrained weights: load ``init``), ``init`` is ``model``'s state dict on
        the CPU.

    Raises:
        KeyError: ``args.dtype`` not "bf16" or "fp32" (the flag's choices prevent it).
    """
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    cfg = GPTConfig(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                    seq_len=args.seq, vocab=args.vocab)

    def build() -> GPT:
        with torch.device(device):
            return GPT(cfg, checkpoint=args.checkpoint).to(dtype=dtype)

    torch.manual_seed(0)
    model = build()
    init = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return cfg, dtype, build, model, init


def run(args, log=print) -> list[Row]:
    """Run every setup ``args.repeats`` times and return its row (with its parity verdict)."""
    device = bench_device()
    capped = args.gpu_bytes is not None and device.type == "cuda"
    if capped:
        _, total = cap_gpu(device, args.gpu_bytes)  # Note [GPU cap device index]
        log(f"GPU capped at {gib(args.gpu_bytes)} GiB of {gib(total)} GiB (--gpu)")
    cfg, dtype, build, model, init = seeded_model(args, device)
    m = args.micro_batches
    flat = learnable_batches(cfg.vocab, args.batch, args.seq,
                             (args.warmup + args.steps + 1) * m, device)
    batches = [flat[i * m:(i + 1) * m] for i in range(args.warmup + args.steps + 1)]
    tokens = args.batch * args.seq * m
    n_params = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.blocks.parameters())
    del model  # each run builds its own
    rate = h2d_bytes_per_s(args.probe, device)
    log(f"model: {n_params / 1e9:.3f}B params, {dtype}, device {device}, {tokens:,} tokens per "
        f"step; blocks' weights {gib(weights)} GiB; H2D {rate / 1e9:.1f} GB/s "
        f"({gib(args.probe)} GiB pinned copy)")
    store = TierStore(StoreConfig(
        device=str(device), gpu_bytes=0, pool_slab_bytes="256MiB" if device.type == "cuda"
        else "1MiB", cpu_bytes=(weights + 16 * n_params + (1 << 20)) // 4096 * 4096 + (2 << 20),
        nvme_bytes=2 * weights + (64 << 20) if args.tier == "nvme" else 0,
        nvme_dir=args.nvme_dir if args.tier == "nvme" else None))
    train = functools.partial(_train, build=build, init=init, batches=batches, store=store,
                              args=args, device=device)
    rows: list[Row] = []
    try:
        for clip_text, clip in args.clips:  # a block per threshold: Note [bench clip rows]
            rows += _clip_block(_setups(args, store, clip), clip_text, train, args.repeats,
                                tokens, rate, log)
    finally:
        gc.unfreeze()  # what _collect froze goes back to the collector
        store.close()
        if capped:  # an in-process caller gets its whole GPU back
            uncap_gpu(device)
    unclipped = {r.setup: r.step_ms for r in rows if r.clip == "off"}
    for r in rows:
        r.vs_off = r.step_ms / unclipped[r.setup] if r.setup in unclipped else None
    return rows


def _collect() -> None:
    """Free what the last run left (its model, optimizer and stream: their cycles) and freeze
    what survives (imports, the store, the batches), so that the next collection scans only
    what later runs allocate: a full collection of the heap torch's imports leave took 0.3-0.5 s
    on a 2-core CPU, twice a run (:func:`run` unfreezes at its end).

    Raises:
        Nothing.
    """
    gc.collect()
    gc.freeze()


def _clip_block(setups: list[Setup], clip_text: str, train: Callable, repeats: int,
                tokens: int, rate: float, log) -> list[Row]:
    """The rows of ``setups`` (all at the ``--max-grad-norm`` entry ``clip_text``), each run
    ``repeats`` times by ``train(setup)``, with their parity: references, baseline and noise
    are this block's own, so a clipped row is judged against its reference clipped alike
    (Note [bench clip rows] in tiermem/apps/bench/optim.py)."""
    rows: list[Row] = []
    runs_of: dict[str, list[list[float]]] = {}
    trades = {s.name: s.trade for s in setups}
    noise = 0.0
    for setup in setups:
        fb, steps, runs, per_step, spec = [], [], [], None, None
        for rep in range(1, repeats + 1):
            fb_s, step_s, losses, per_step, diag, spec = train(setup)
            _collect()
            fb.append(1e3 * statistics.median(fb_s))
            steps.append(1e3 * statistics.median(step_s))
            runs.append(losses)
            if spec is not None:  # the table's spec/rb: over the timed steps
                diag += f"; timed steps: spec/rb {spec[0]}/{spec[1]}"
            log(f"  {setup.name}, clip {clip_text}: run {rep}/{repeats}: {steps[-1]:.1f} "
                f"ms/step" + (f" (last step: {diag})" if diag else ""))
        runs_of[setup.name] = runs
        if setup.reference is None:
            parity = "baseline"
        else:
            if setup.name == AGAIN:  # the baseline's noise: every run against the first
                base = runs_of[BASELINE]
                noise = max(noise_of(base[0], r) for r in base[1:] + runs)
            ref = runs_of[setup.reference][0]
            parity = worst_verdict([verdict(r, ref, noise, setup.trade) for r in runs])
            parity += f" vs {setup.reference}"
            if setup.reference != BASELINE:  # and beside it, against the baseline itself
                trade = trades[setup.reference]
                base = worst_verdict([verdict(r, runs_of[BASELINE][0], noise, trade)
                                      for r in runs])
                parity += f"; {base} vs {BASELINE}"
        step_ms = statistics.median(steps)
        pcie = None if per_step is None else 1e3 * per_step / rate
        rows.append(Row(setup.name, step_ms, (min(steps), max(steps)), statistics.median(fb),
                        tokens / (step_ms / 1e3), per_step, pcie, parity, runs[0],
                        clip=clip_text, spec=spec))
        log(f"  {setup.name}, clip {clip_text}: {step_ms:.1f} ms/step, {parity}")
        _collect()
    return rows


PAIRS = ((STREAMED, BASELINE, "AdamW"), (HYBRID_STREAMED, HYBRID_REF, "HybridAdam"))
"""(streamed row, the resident row with the same optimizer, the optimizer) of the ratio lines."""


def format_table(rows: list[Row]) -> str:
    """The rows as a fixed-width table (x = step ms over the baseline's at the same clip, vs
    off = over the same setup's unclipped row), then one line per optimizer and clip with
    both its streamed and resident rows: streamed over resident, step and fwd+bwd times."""
    ref = {r.clip: r.step_ms for r in rows if r.setup == BASELINE}
    text = table.render(
        [table.Column("setup", align="<"), table.Column("clip"), table.Column("step ms", 9),
         table.Column("spread", 15), table.Column("fwd+bwd ms", 10), table.Column("x", 6),
         table.Column("vs off", 6), table.Column("tokens/s", 9),
         table.Column("streamed GiB", 12), table.Column("PCIe floor ms", 13),
         table.Column("spec/rb", 7), table.PARITY],
        [(r.setup, r.clip, f"{r.step_ms:.1f}", table.spread(r.spread_ms), f"{r.fwd_bwd_ms:.1f}",
          table.ratio(r.step_ms, ref.get(r.clip)),
          "-" if r.vs_off is None else f"{r.vs_off:.2f}x", f"{r.tokens_per_s:,.0f}",
          gib(r.streamed_bytes, 3), "-" if r.pcie_floor_ms is None else f"{r.pcie_floor_ms:.1f}",
          "-" if r.spec is None else f"{r.spec[0]}/{r.spec[1]}", r.parity)
         for r in rows])
    at = {(r.setup, r.clip): r for r in rows}
    lines = [text]
    for streamed, resident, opt in PAIRS:
        for clip in dict.fromkeys(r.clip for r in rows):  # the grid's order
            s, res = at.get((streamed, clip)), at.get((resident, clip))
            if s is not None and res is not None:
                lines.append(f"streamed vs resident, {opt}, clip {clip}: "
                             f"{table.ratio(s.step_ms, res.step_ms)} step, "
                             f"{table.ratio(s.fwd_bwd_ms, res.fwd_bwd_ms)} fwd+bwd")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table; returns the exit code (0 ok, 1 a row's losses
    are not its reference's, 2 bad input)."""
    return bench_main(
        argv, _parse_args,
        lambda a: (f"tiermem bench stream: layers={a.layers} d_model={a.d_model} heads={a.heads} "
                   f"seq={a.seq} batch={a.batch} micro_batches={a.micro_batches} vocab={a.vocab} "
                   f"tier={a.tier} prefetch_blocks={a.prefetch_blocks} schedule={a.schedule} "
                   f"checkpoint={a.checkpoint} gpu={a.gpu or 'uncapped'} steps={a.steps} "
                   f"repeats={a.repeats} (median ms/step after {a.warmup} warm-up) "
                   f"max_grad_norm={','.join(t for t, _ in a.clips)} "
                   f"rollback_bytes={a.rollback}"),
        run, format_table,
        lambda rows: [f"{r.setup} (clip {r.clip})" for r in rows if r.parity.startswith("WRONG")],
        baseline="their references (clipped alike)")


if __name__ == "__main__":
    sys.exit(main())
