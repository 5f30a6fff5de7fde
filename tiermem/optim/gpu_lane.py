"""HybridAdam's GPU lane (Note [gpu lane]): offloaded chunks the GPU steps by streaming their
state through ``LANE_SLOTS`` device slots, and torch's fused Adam on fp32 or bf16 moments
(:func:`fused_adam_moments_`), which the lane and the GPU side both step with.

Note [gpu lane]: the CPU kernel is bound by host memory bandwidth (~28 bytes per param and step:
fp32 master and moments read and written, bf16 gradient in, bf16 param out), while the GPU's
copy engines reach host memory over PCIe on their own. With ``gpu_step_fraction > 0`` a share of
the offloaded chunks (spread evenly over the order they are stepped in) is stepped by the GPU
instead: the worker issues the chunk's state blob H2D into one of ``LANE_SLOTS`` device slots
(after the slot's previous write-back), and on a lane stream that waits for the load and the
gradients' events, widens the chunk's gradients to fp32 where backward left them, runs torch's
fused Adam on the chunk's runs (the same kernel as the GPU side), casts the updated params into
the model and records the event forward and ``step()`` wait on; the state then goes D2H back
into its blob. The worker does not wait: it goes on to the next chunk, and releases a lane
chunk's blob (counting it done for ``step()``) only when its write-back has finished. The state
never lives on the GPU: it stays in the store's cpu tier (or streams through nvme) between
steps. Gradients of lane chunks never leave the GPU and their params are not copied H2D.

Note [lane unscale]: under a ``torch.amp.GradScaler`` a lane chunk admitted to a speculative
step (Note [grad scaler overlap] in amp_scaling.py) reads ``p.grad`` before ``step()`` has
unscaled it, so the lane unscales its own fp32 gradient copy (never ``p.grad``: the user's and
the scaler's) on the lane stream: :func:`unscale_lane_` multiplies it by the reciprocal of a
snapshot of the scaler's ``_scale``, computed as ``GradScaler.unscale_`` computes it (fp64
reciprocal rounded to fp32, on the device), with torch's
``_amp_foreach_non_finite_check_and_unscale_``, whose fp32 product is ``GradScaler.unscale_``'s
for an fp32 gradient; a bf16 gradient's copy is then rounded to bf16 and widened back (exact),
the product ``unscale_`` would have stored in ``p.grad`` before the lane widened it. The
snapshot is taken on a small scale stream once the chunk's gradients' events are reached (the
scale the loss was scaled by: the previous ``scaler.update()`` precedes the forward) and
copied from there to a pinned host scalar; the lane stream waits for it before the unscale, and
``step()`` (:meth:`Speculation.close` in speculate.py, through ``lane_scale_read``) waits for
that copy -- behind the gradients only, not behind the lane's earlier chunks -- and compares
the value with the scale it is given, as the worker's for a host chunk: another scale rolls the
chunk back. ``scaler.update()`` cannot overwrite the scale while the lane reads it: ``step()``
makes the caller's stream wait for every admitted chunk's step (or, on a skipped step, drains
the lane) before it returns. A chunk stepped again after a rollback, or one that waited for the
verdict, reads ``p.grad`` unscaled by ``step()`` and unscales nothing. Cost: one pass over the
chunk's fp32 gradient copy on the GPU (with bf16 gradients a transient bf16 copy of it), a
4-byte copy to the host per speculated lane chunk, and in ``step()`` one event wait each.
"""

from __future__ import annotations

import collections
from contextlib import nullcontext as _nullcontext

import torch

from tiermem.optim.layout import LANE_SLOTS, StateLayout, local_view, runs, state_numel, state_views
from tiermem.optim.partition import Chunk
from tiermem.optim.read_ahead import ReadAhead
from tiermem.optim.step_state import StepState
from tiermem.store.transfer import Copier


def fused_adam_(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, steps: list,
                hp: dict) -> None:
    """torch's fused Adam/AdamW (``hp``: a param group's hyper-parameters) on fp32 tensors, in
    place, on the current stream; ``steps`` are the already incremented step tensors.

    Raises:
        RuntimeError: this torch has no fused Adam op (torch < 2.4).
    """
    fused = getattr(torch, "_fused_adamw_" if hp["adamw"] else "_fused_adam_", None)
    if fused is None:
        raise RuntimeError("HybridAdam needs torch._fused_adamw_ (torch >= 2.4)")
    beta1, beta2 = hp["betas"]
    fused(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=hp["lr"], beta1=beta1, beta2=beta2,
          weight_decay=hp["weight_decay"], eps=hp["eps"], amsgrad=False,
          maximize=hp["maximize"], grad_scale=None, found_inf=None)


def fused_adam_moments_(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list,
                        steps: list, hp: dict) -> None:
    """:func:`fused_adam_` on moments stored in fp32 or bf16 (HybridAdam's ``moments_dtype``,
    the same for every tensor): fp32 moments are stepped in place, without a copy; bf16 moments
    are widened to fp32 copies (exact), stepped, and rounded back to nearest even, as the CPU
    kernel does with them: the GPU side, the lane and the CPU kernel keep the same moments
    and differ only where their fp32 arithmetic does (none on a CPU device for elements in the
    vector body of torch's kernel; torch's CUDA kernel may round an fp32 value one ulp away
    from the CPU kernel, with fp32 moments alike). The fp32 copies are transient, 8 bytes per
    element passed, so callers bound what they pass (the lane: one chunk; the GPU side:
    ``WIDE_BATCH_NUMEL`` elements).

    Raises:
        RuntimeError: this torch has no fused Adam op (torch < 2.4).
    """
    if not exp_avgs or exp_avgs[0].dtype == torch.float32:
        fused_adam_(params, grads, exp_avgs, exp_avg_sqs, steps, hp)
        return
    m32 = [m.float() for m in exp_avgs]
    v32 = [v.float() for v in exp_avg_sqs]
    fused_adam_(params, grads, m32, v32, steps, hp)
    for m, v, a, b in zip(exp_avgs, exp_avg_sqs, m32, v32):
        m.copy_(a)
        v.copy_(b)


def unscale_lane_(pieces: list[tuple[torch.Tensor, torch.dtype]], scale: torch.Tensor) -> None:
    """Multiply the lane's fp32 gradient copies in place by ``1 / scale`` as
    ``GradScaler.unscale_`` multiplies the gradients they were copied from (Note [lane
    unscale]): ``pieces`` are ``(fp32 copy, the source gradient's dtype)`` on one device,
    ``scale`` the scaler's scale tensor; on the current stream.

    Raises:
        Nothing beyond torch's errors.
    """
    if not pieces:
        return
    device = pieces[0][0].device
    inv_scale = scale.double().reciprocal().float()  # fp64, as GradScaler.unscale_
    found = torch.zeros((), dtype=torch.float32, device=device)  # step() has the scaler's own
    torch._amp_foreach_non_finite_check_and_unscale_(  # a host copy is read at once: blocking
        [t for t, _ in pieces], found, inv_scale.to(device, non_blocking=device.type != "cpu"))
    for t, dtype in pieces:
        if dtype != torch.float32:  # the product unscale_ stores in a bf16 p.grad, widened
            t.copy_(t.to(dtype))


class GpuLane:
    """The chunks the GPU steps, its device slots and streams; ``step`` issues a chunk and
    ``reap`` releases the chunks whose state is back in the store (worker thread only, but
    ``init``/``clear`` on the caller's thread while the worker is idle).

    Attributes:
        chunks: ``(group, chunk)`` the lane steps (empty: no lane).
    """

    def __init__(self, layout: StateLayout, step: StepState, read_ahead: ReadAhead,
                 param_groups: list[dict], fraction: float, cuda: bool) -> None:
        """Args: the optimizer's layout, step state and read-ahead, its ``param_groups`` (the
        live hyper-parameters), ``gpu_step_fraction`` and whether the device is CUDA.

        Raises:
            Nothing: slots are allocated by :meth:`init`.
        """
        self._layout = layout
        self._step = step
        self._read_ahead = read_ahead
        self._param_groups = param_groups
        self._fraction = fraction
        self._cuda = cuda
        self.chunks: set[tuple[int, int]] = set()
        self._state: list[torch.Tensor] = []  # device slots: a chunk's state blob
        self._grad: list[torch.Tensor] = []  # device slots: a chunk's fp32 gradients
        self._free: list = []  # per slot: event after which the slot may be overwritten
        self._next = 0
        self._pending: collections.deque = collections.deque()  # (event, g, c) written back
        self._stream = None
        self._scale_stream = None  # the scale's snapshots under a GradScaler: Note [lane unscale]
        self._copier: Copier | None = None  # its own H2D/D2H streams (see init)
        self.rollback: list[torch.Tensor] = []  # device copies of speculated chunks' state
        if step.speculation is not None:  # Note [lane rollback on the GPU] (speculate.py)
            step.speculation.bind_lane(self)

    @property
    def pending(self) -> bool:
        """Whether a lane chunk's write-back has not been reaped yet.

        Raises:
            Nothing.
        """
        return bool(self._pending)

    def device_bytes(self) -> int:
        """Bytes of the lane's device slots (state and fp32 gradients).

        Raises:
            Nothing.
        """
        return sum(t.numel() * t.element_size()
                   for t in self._state + self._grad + self.rollback)

    def alloc_rollback(self, n: int) -> None:
        """Allocate ``n`` device slots, each one lane chunk's state blob, for the pre-step
        copies of speculated lane chunks (Note [lane rollback on the GPU] in speculate.py;
        caller's thread, worker idle).

        Raises:
            torch.OutOfMemoryError: no room on the device (nothing is kept).
        """
        groups = self._layout.groups
        numel = max(groups[g].plan.chunks[c].numel for g, c in self.chunks)
        self.rollback = [torch.empty(state_numel(numel, self._layout.moments_dtype),
                                     dtype=torch.float32, device=self._layout.device)
                         for _ in range(n)]

    def init(self) -> None:
        """Pick the lane's chunks (``gpu_step_fraction`` of the offloaded chunks, spread evenly
        over the order they are stepped in) and allocate its device slots.

        Raises:
            torch.OutOfMemoryError: no room on the device for the slots.
        """
        self.chunks = set()
        if self._fraction == 0.0:
            return
        order = self._layout.expected_order()
        share = self._fraction
        self.chunks = {item for k, item in enumerate(order)
                       if int((k + 1) * share) > int(k * share)}
        if not self.chunks:
            return
        groups = self._layout.groups
        chunks = [groups[g].plan.chunks[c] for g, c in self.chunks]
        numel = max(c.numel for c in chunks)
        device = self._layout.device
        self._state = [torch.empty(state_numel(numel, self._layout.moments_dtype),
                                   dtype=torch.float32, device=device)
                       for _ in range(LANE_SLOTS)]
        self._grad = [torch.empty(numel, dtype=torch.float32, device=device)
                      for _ in range(LANE_SLOTS)]
        self._free = [None] * LANE_SLOTS
        # own copy streams: a lane copy waits for lane work, which must never hold up the CPU
        # chunks' gradient and param copies queued behind it on shared streams
        self._copier = Copier(device)
        if self._cuda:
            self._stream = torch.cuda.Stream(device)
            self._scale_stream = torch.cuda.Stream(device)

    def clear(self) -> None:
        """Forget the chunks and the slots (a failed state allocation is undone).

        Raises:
            Nothing.
        """
        self.chunks = set()
        self._state, self._grad, self._free, self.rollback = [], [], [], []

    def step(self, g: int, c: int) -> None:
        """Step chunk ``c`` on the GPU (Note [gpu lane]): its state H2D into a device slot, the
        fused Adam on the lane stream with the gradients where backward left them, the updated
        params cast into the model, the state D2H back into its blob. Issues and returns; the
        blob stays held until :meth:`reap` sees the write-back done.

        Raises:
            Exception: from the store or a copy; what was issued has finished and the blob is
                released.
        """
        layout, moments_dtype = self._layout, self._layout.moments_dtype
        group = layout.groups[g]
        chunk: Chunk = group.plan.chunks[c]
        refs, waits = self._step.chunk_grads(g, chunk)
        has_grad = {p: ref is not None for p, ref in refs.items()}
        key = group.chunk_keys[c]
        blob = layout.store.get(key, "cpu", hold=True)
        loaded = None
        spec = self._step.speculation
        try:
            # Note [lane unscale]: (host scalar, the scaler's scale) when admitted early under
            # a scaler; asked before lane_copy/prepare_state, which clear the restep mark
            scaled = spec.amp.scale_to_copy((g, c)) if spec is not None else None
            # Note [lane rollback on the GPU]: a device slot for the pre-step state, or none
            keep = spec.lane_copy((g, c)) if spec is not None else None
            if keep is None:
                self._step.prepare_state((g, c), blob)  # Note [speculative step]: host copy
            self._read_ahead.after(g, c)
            slot = self._next
            self._next = (slot + 1) % LANE_SLOTS
            state = self._state[slot][:state_numel(chunk.numel, moments_dtype)]
            grads = self._grad[slot]
            restore = keep is not None and keep[1]
            if not restore:  # a rolled-back chunk's blob holds its speculative step's result
                loaded = self._copier.h2d_many([(state, blob)], after=self._free[slot])
            cuda = self._stream is not None
            with torch.cuda.stream(self._stream) if cuda else _nullcontext():
                if cuda:
                    if loaded is not None:
                        self._stream.wait_event(loaded)  # the state is on the device
                    elif self._free[slot] is not None:
                        self._stream.wait_event(self._free[slot])  # the slot's write-back read it
                    for ev in waits:
                        self._stream.wait_event(ev)  # the gradients are complete
                if keep is not None:
                    saved = keep[0][:state.numel()]
                    if restore:
                        state.copy_(saved)  # master and moments as before the rolled-back step
                    else:
                        saved.copy_(state)  # kept until step() knows the norm
                master, exp_avg, exp_avg_sq = state_views(state, chunk.numel, moments_dtype)
                lo = chunk.flat_start
                pieces = []
                for pc in chunk.pieces:
                    if has_grad[pc.param]:
                        rel = pc.flat_offset - lo
                        src = refs[pc.param][0][pc.start:pc.start + pc.numel]
                        grads[rel:rel + pc.numel].copy_(src)  # widened to fp32
                        pieces.append((grads[rel:rel + pc.numel], src.dtype))
                self._step.reads.read(  # Note [gradient writes after a forward-synced step]
                    g, c, [(pc.param, refs[pc.param][0][pc.start:pc.start + pc.numel])
                           for pc in chunk.pieces if has_grad[pc.param]], self._stream)
                if scaled is not None:  # Note [lane unscale]: the copy, never p.grad
                    self._unscale(g, c, pieces, waits, *scaled)
                hp = self._step.hyperparams(g, self._param_groups)
                chunk_runs = runs(group, chunk, has_grad)
                if chunk_runs:
                    self._fused_runs(master, grads, exp_avg, exp_avg_sq, chunk_runs, hp)
                with layout.watch.writing((g, pc.param) for pc in chunk.pieces
                                          if has_grad[pc.param]):  # Note [param changes]
                    for pc in chunk.pieces:
                        if has_grad[pc.param]:
                            rel = pc.flat_offset - lo
                            local_view(group, pc.param)[pc.start:pc.start + pc.numel].copy_(
                                master[rel:rel + pc.numel])
                stepped = None
                if cuda:
                    stepped = torch.cuda.Event()
                    stepped.record(self._stream)  # params updated; the state may go back
            written = self._copier.d2h_many([(blob, state)], after=stepped)
        except BaseException:  # error path: let what was issued finish before the blob goes
            if loaded is not None:
                loaded.synchronize()  # the state load has read the blob
            if self._stream is not None:
                self._stream.synchronize()  # nothing queued still uses the slot
            layout.store.release(key)
            raise
        self._free[slot] = written
        if keep is not None and not restore:
            spec.mark_saved((g, c))  # its copy is issued before anything that changes the slot
        # the lane's PCIe traffic is the state, both ways (a restore loads it on the device)
        self._step.add_stats(h2d_bytes=0 if restore else state.numel() * 4,
                             d2h_bytes=state.numel() * 4, chunks=1, gpu_chunks=1)
        self._step.chunk_issued((g, c), stepped)
        self._pending.append((written, g, c))

    def _unscale(self, g: int, c: int, pieces: list[tuple[torch.Tensor, torch.dtype]],
                 waits: list, host: torch.Tensor, scale: torch.Tensor) -> None:
        """Unscale lane chunk ``c``'s gradient copies ``pieces`` by the scaler's ``scale`` and
        hand that scale, copied into ``host``, to ``step()`` (Note [lane unscale]). On CUDA a
        snapshot of the scale is taken on the scale stream once the gradients' events
        (``waits``) are reached, copied to the pinned ``host`` there, and the lane stream (the
        current one) unscales by that snapshot: ``step()`` compares the very value the lane
        used, and its wait for the copy does not queue behind the lane's earlier chunks. No
        gradient: nothing unscaled, any scale will do (nothing recorded). Worker thread.

        Raises:
            Nothing beyond torch's errors.
        """
        if not pieces:
            return
        if self._stream is None:  # the lane on the CPU: in order, now
            host.copy_(scale)
            unscale_lane_(pieces, host)
            self._step.speculation.lane_scale_read((g, c), host, None)
            return
        with torch.cuda.stream(self._scale_stream):
            for ev in waits:
                self._scale_stream.wait_event(ev)  # the gradients are complete: their scale
            snap = scale.detach().to(torch.float32, copy=True)
            host.copy_(snap, non_blocking=True)  # pinned: the host does not wait here
            read = torch.cuda.Event()
            read.record(self._scale_stream)  # snapshot and host copy done: lane and step() read
        snap.record_stream(self._stream)  # the lane's unscale reads it after the scale stream
        self._stream.wait_event(read)  # the lane unscales by the snapshot step() compares
        unscale_lane_(pieces, snap)
        self._step.speculation.lane_scale_read((g, c), host, read)

    def _fused_runs(self, master: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, chunk_runs: list[tuple[int, int, int]],
                    hp: dict) -> None:
        """torch's fused Adam on the ``(start, numel, step)`` runs of a chunk in place (on the
        current stream); bf16 moments are widened to fp32 and rounded back, as the CPU kernel
        and the GPU side (:func:`fused_adam_moments_`)."""
        sl = [slice(start, start + numel) for start, numel, _ in chunk_runs]
        steps = [torch.full((), float(step), dtype=torch.float32, device=master.device)
                 for _, _, step in chunk_runs]
        fused_adam_moments_([master[k] for k in sl], [grads[k] for k in sl],
                            [exp_avg[k] for k in sl], [exp_avg_sq[k] for k in sl], steps, hp)

    def reap(self, block: bool) -> None:
        """Release the blobs of lane chunks whose state is back in the store (with ``block``,
        after waiting for the oldest); each counts as done for ``step()`` only then. Worker
        thread only.

        Raises:
            Nothing: errors are recorded for ``step()``.
        """
        layout = self._layout
        while self._pending:
            written, g, c = self._pending[0]
            if written is not None and not block and not written.query():
                return
            block = False
            self._pending.popleft()
            try:
                if written is not None:
                    written.synchronize()  # the host blob holds the updated state after this
                key = layout.groups[g].chunk_keys[c]
                layout.store.release(key)
                if (g, c) in layout.nvme_chunks:
                    layout.store.evict(key, "nvme")  # write-back overlaps the next chunks
            except BaseException as exc:  # surfaced by step()
                self._step.fail(exc)
            finally:
                self._step.chunk_done()
