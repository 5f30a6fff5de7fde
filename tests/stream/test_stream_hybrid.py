"""HybridAdam steps streamed weights exactly (Note [streamed write-back] in
tiermem/optim/streamed.py, Note [streamed gradient hand-off] in tiermem/stream/grads.py): a
small GPT with its blocks streamed, trained by HybridAdam, gives at every step the same losses,
weights and optimizer state, bit for bit, as a separately built GPT from the same seed trained
by HybridAdam without streaming; checkpoint resume continues bit-identically; a host copy one
step stale (a skipped write-back, a skipped NVMe rewrite) makes the comparison fail."""

from __future__ import annotations

import io
import threading

import pytest
import torch

from tiermem.optim.hybrid_adam import HybridAdam
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights

from _stream_train import assert_same_steps, batches, make_model, step_snapshot

STEPS = 8


@pytest.fixture
def stores(make_stream_store):
    """``stores(nvme)``: a CPU store, no GPU budget, 8 MiB RAM; ``nvme``: a 64 MiB NVMe tier."""
    return lambda nvme: make_stream_store(gpu_bytes=0, cpu_bytes=8 << 20,
                                          **({"nvme_bytes": 64 << 20} if nvme else {}))


def _optimizer(model, cfg, store):
    return HybridAdam(model.parameters(), lr=3e-3, weight_decay=0.1,
                      offload_fraction=cfg["fraction"], chunk_numel=2048,
                      max_grad_norm=cfg["clip"], grad_accumulation_steps=cfg["n_micro"],
                      state_tier=cfg["state_tier"],
                      store=store if cfg["state_tier"] != "cpu" else None,
                      param_sync=cfg.get("sync", "step"),
                      gpu_step_fraction=cfg.get("lane", 0.0))


class Run:
    """One training run; ``streamed``: the blocks' weights streamed (made before HybridAdam)."""

    def __init__(self, cfg, stores, streamed, seed=0):
        self.cfg = cfg
        self.model = make_model(cfg.get("dtype", torch.float32), seed=seed,
                                checkpoint=cfg.get("ckpt", False))
        nvme = cfg["tier"] == "nvme" or cfg["state_tier"] != "cpu"
        self.store = stores(nvme)
        self.stream = stream_weights(self.model.blocks, store=self.store, tier=cfg["tier"],
                                     prefetch_blocks=cfg.get("prefetch", 1),
                                     resident=cfg.get("resident")) if streamed else None
        self.opt = _optimizer(self.model, cfg, stores(cfg["state_tier"] != "cpu"))

    def step(self, step):
        cfg = self.cfg
        losses = forward_backward(self.model, batches(step, cfg["n_micro"]),
                                  block_major=cfg["block_major"])
        return step_snapshot(self.model, self.opt, losses)

    def close(self):
        self.opt.close()
        if self.stream is not None:
            self.stream.close()


def _train(cfg, stores, streamed, steps=range(STEPS)):
    run = Run(cfg, stores, streamed)
    try:
        return [run.step(s) for s in steps]
    finally:
        run.close()


def _cfg(tier, state_tier, fraction, n_micro, clip, block_major, **kw):
    return dict(tier=tier, state_tier=state_tier, fraction=fraction, n_micro=n_micro,
                clip=clip, block_major=block_major, **kw)


CASES = {
    "cpu-f1": _cfg("cpu", "cpu", 1.0, 1, None, False),
    "cpu-f1-acc2-clip": _cfg("cpu", "cpu", 1.0, 2, 0.5, False),
    "cpu-f05-acc2-clip-major": _cfg("cpu", "cpu", 0.5, 2, 0.5, True),
    "cpu-f05-major-overlap": _cfg("cpu", "cpu", 0.5, 2, None, True),
    "nvme-f1-nvmestate": _cfg("nvme", "nvme", 1.0, 1, None, False),
    "nvme-f05-acc2-clip-split": _cfg("nvme", "split", 0.5, 2, 0.5, False),
    "nvme-f1-acc2-major-clip": _cfg("nvme", "cpu", 1.0, 2, 0.5, True),
    "cpu-ckpt-resident3-prefetch0": _cfg("cpu", "cpu", 0.5, 1, None, False, ckpt=True,
                                         resident=(3,), prefetch=0),
    "cpu-bf16-lane-forward": _cfg("cpu", "cpu", 1.0, 2, None, False, dtype=torch.bfloat16,
                                  lane=0.5, sync="forward"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_streamed_hybrid_adam_is_bit_identical(stores, one_thread, name):
    cfg = CASES[name]
    want = _train(cfg, stores, streamed=False)
    got = _train(cfg, stores, streamed=True)
    assert_same_steps(got, want, name)
    assert not torch.equal(want[0][1]["blocks.0.qkv.weight"],
                           want[-1][1]["blocks.0.qkv.weight"])  # the weights moved


@pytest.mark.parametrize("name", ["cpu-f1-acc2-clip", "nvme-f05-acc2-clip-split"])
def test_checkpoint_resume_continues_bit_identically(stores, one_thread, name):
    cfg = CASES[name]
    want = _train(cfg, stores, streamed=True)
    first = Run(cfg, stores, streamed=True)
    for s in range(4):
        first.step(s)
    buf = io.BytesIO()
    torch.save({"model": first.model.state_dict(), "opt": first.opt.state_dict()}, buf)
    first.close()
    buf.seek(0)
    saved = torch.load(buf)
    second = Run(cfg, stores, streamed=True, seed=1)  # other initial weights: the load matters
    try:
        second.model.load_state_dict(saved["model"])
        second.opt.load_state_dict(saved["opt"])
        got = [second.step(s) for s in range(4, STEPS)]
    finally:
        second.close()
    assert_same_steps(got, want[4:], name + " resumed")


def test_stale_host_copy_is_caught(stores, one_thread, monkeypatch):
    """Skip the write-back of one chunk's updated weights into the host copies at step 3: the
    next forward streams a one-step-stale weight and the comparison must fail."""
    from tiermem.store.transfer import Copier

    cfg = CASES["cpu-f1"]
    want = _train(cfg, stores, streamed=False)
    real = Copier.h2d_many
    armed = {"on": False}

    def skipping(self, pairs, after=None):
        if armed["on"]:  # the first write-back of step 3 (a chunk of the last blocks)
            armed["on"] = False
            return None
        return real(self, pairs, after)

    monkeypatch.setattr(Copier, "h2d_many", skipping)
    run = Run(cfg, stores, streamed=True)
    got = []
    try:
        for step in range(STEPS):
            armed["on"] = step == 3
            got.append(run.step(step))
    finally:
        run.close()
    assert not armed["on"]
    with pytest.raises(AssertionError, match="step 3"):
        assert_same_steps(got, want, "slip")


def test_stale_nvme_copy_is_caught(stores, one_thread, monkeypatch):
    """With tier='nvme', skip HybridAdam's mark_changed: the host copies' checksums still show
    the change and the NVMe copies are rewritten (Note [streamed weight checksums]); with the
    checksums blinded too, the NVMe copy stays one step stale and the comparison fails."""
    from tiermem.stream import weights
    from tiermem.stream.weights import WeightStream

    cfg = CASES["nvme-f1-nvmestate"]
    want = _train(cfg, stores, streamed=False)
    monkeypatch.setattr(WeightStream, "mark_changed", lambda self, param: None)
    assert_same_steps(_train(cfg, stores, streamed=True), want, "checksummed")
    monkeypatch.setattr(weights, "host_checksum", lambda t: 0)
    got = _train(cfg, stores, streamed=True)
    with pytest.raises(AssertionError, match="step 1"):
        assert_same_steps(got, want, "slip")


def test_gradients_reach_hybrid_adam_through_the_stream(stores, one_thread):
    """No HybridAdam hook on a streamed weight: its gradient arrives through HostGrads.take
    (the stream's hand-off), and HybridAdam writes the host copy the stream holds."""
    cfg = CASES["cpu-f1"]
    run = Run(cfg, stores, streamed=True)
    try:
        p = run.model.blocks[0].qkv.weight
        host = run.stream.host_copy(p)
        assert not p._post_accumulate_grad_hooks or len(p._post_accumulate_grad_hooks) == 1
        before = host.clone()
        run.step(0)
        assert p.data.data_ptr() == host.data_ptr()
        assert not torch.equal(host, before)
    finally:
        run.close()


def test_refusals(stores, one_thread):
    model = make_model()
    store = stores(False)
    opt = HybridAdam(model.parameters(), lr=1e-3, chunk_numel=2048)
    with pytest.raises(RuntimeError, match="build the WeightStream first"):
        with stream_weights(model.blocks, store=store):
            forward_backward(model, batches(0, 1))
    opt.close()
    model = make_model()
    stream = stream_weights(model.blocks, store=store)
    opt = HybridAdam(model.parameters(), lr=1e-3, chunk_numel=2048)
    with pytest.raises(ValueError, match="already stepped by another HybridAdam"):
        HybridAdam(model.parameters(), lr=1e-3, chunk_numel=2048)
    # (Note [one optimizer per param] refuses it before the stream's own check could)
    with pytest.raises(RuntimeError, match="close\\(\\) the optimizer first"):
        stream.close()
    opt.close()
    stream.close()


class _Event:
    """A fake CUDA event: the copy it marks happens when the test completes it; a wait on it
    (the gradient adder thread's, Note [gradient adder]) blocks until then, like
    ``cudaEventSynchronize``."""

    def __init__(self, copy):
        self.copy, self.done = copy, False
        self.landed = threading.Event()

    def complete(self):
        if not self.done:
            self.copy()
            self.done = True
            self.landed.set()


class _Copies:
    """StreamCopies as HostGrads sees it on CUDA, with copies landing when the test says."""

    cuda = True

    def __init__(self):
        self.events = []

    def grad_out(self, dst, src):
        self.events.append(_Event(lambda: dst.copy_(src)))
        return self.events[-1]

    @staticmethod
    def finished(event):
        return event.done

    @staticmethod
    def landed(event):
        assert event.landed.wait(60), "deadlock guard: a copy the test never completes"


class _Entry:
    def __init__(self, name):
        self.name, self.acc, self.staging, self.dev_sum = name, None, None, None


def test_cuda_hand_off_is_at_once_with_the_copy_event_and_keeps_backward_order():
    """Note [streamed gradient hand-off] on the CUDA path (fake events): a gradient copied
    straight into its host gradient is handed over at once with its copy's event (in flight),
    or with None once landed; a staged micro-batch is handed over (by the adder thread, Note
    [gradient adder]) only once its copy has landed and been added, and holds back the ones
    taken after it (take order)."""
    from tiermem.stream.grads import HostGrads

    copies = _Copies()
    grads = HostGrads(copies, pin=False)
    told = []
    grads.sink = lambda e, passes, event: told.append((e.name, passes, event, e.acc.clone()))
    a, b, c, d = _Entry("a"), _Entry("b"), _Entry("c"), _Entry("d")
    ga, gb, gc = torch.full((3,), 1.5), torch.full((3,), 2.5), torch.full((3,), 3.5)
    grads.take(a, ga)
    grads.take(b, gb, passes=4)
    assert [(t[0], t[1]) for t in told] == [("a", 1), ("b", 4)]  # nothing landed: at once
    assert told[0][2] is copies.events[0] and told[1][2] is copies.events[1]
    copies.events[0].complete()  # a's copy lands
    grads.take(c, gc)
    assert told[2][:3] == ("c", 1, copies.events[2])
    grads.take(a, ga)  # a second micro-batch of a: staged, added once landed
    grads.take(d, gc)  # straight, but taken after a's staged one: held back
    assert len(told) == 3  # the adder thread waits for a's copy
    for k in (1, 2, 3):  # the copies land in issue order, up to a's staged one
        copies.events[k].complete()
    grads._adder.wait_idle()
    assert [(t[0], t[1]) for t in told[3:]] == [("a", 1), ("d", 1)]
    assert told[3][2] is None and torch.equal(told[3][3], ga + ga)  # told after the add
    assert told[4][2] is copies.events[4]  # d's copy still in flight
    grads.take(c, gc)  # c's second micro-batch: staged, held until it is added
    assert len(told) == 5
    copies.events[4].complete()
    copies.events[5].complete()
    grads.flush()
    assert [(t[0], t[2]) for t in told[5:]] == [("c", None)]
    assert torch.equal(c.acc, gc + gc) and torch.equal(b.acc, gb)
    # c: handed by the adder as soon as added, during the pass or by flush()'s wait
    assert grads.handed["handed_in_pass"] + grads.handed["handed_at_end"] == 6
    assert grads.handed["handed_in_pass"] >= 5
    assert grads.stats()["adds_off_thread"] == 2


class _LateCopy:
    """A D2H copy's CUDA event, stood in: its copy writes the host gradient only when the event
    completes (``synchronize()``, the worker's wait, or ``landed()``, the pass end's), and
    ``query()`` says not done until then, like a copy still in flight."""

    def __init__(self, dst, src):
        self.dst, self.src, self.done, self.by = dst, src, False, None
        self._lock = threading.Lock()

    def query(self):
        return self.done

    def synchronize(self):
        with self._lock:
            if not self.done:
                self.dst.data.copy_(self.src)  # .data: the landing bumps no version, like DMA
                self.done, self.by = True, threading.current_thread().name


class _LateCopies:
    """StreamCopies as HostGrads sees it on CUDA, with :class:`_LateCopy` copies: issuing one
    fills the host gradient with NaN (what an unlanded copy leaves to a premature reader) and
    bumps its version, as the real ``copy_`` does when it is issued."""

    cuda = True

    def __init__(self):
        self.events = []

    def grad_out(self, dst, src):
        dst.fill_(float("nan"))
        self.events.append(_LateCopy(dst, src))
        return self.events[-1]

    @staticmethod
    def finished(event):
        return event.query()

    @staticmethod
    def landed(event):
        event.synchronize()


def test_the_worker_waits_for_each_streamed_gradients_own_copy(stores, one_thread):
    """Note [streamed gradient hand-off], Note [hand-off lag]: on the CUDA path (stand-in
    events whose copies land only when waited on) every streamed gradient is handed over
    during the pass (none at its end), with its copy's event, and HybridAdam's worker waits on
    that event before it reads the host gradient: the pass end lands nothing until the worker
    has stepped every chunk shipped during backward, so a worker that read a host gradient
    before its copy landed would step NaN. Bit-identical to HybridAdam without streaming."""
    cfg = CASES["cpu-f1"]
    want = _train(cfg, stores, streamed=False)
    run = Run(cfg, stores, streamed=True)
    copies = _LateCopies()
    grads = run.stream._grads
    grads.copies = copies
    real_flush = grads.flush
    step_state = run.opt._step

    def flush():  # the pass ends only once the worker is idle: what it read, it waited for
        with step_state.idle:
            step_state.idle.wait_for(lambda: step_state.outstanding == 0, timeout=120)
        real_flush()

    grads.flush = flush
    n_streamed = sum(1 for b in run.model.blocks for _ in b.parameters())
    got, by_worker = [], []
    try:
        for step in range(STEPS):
            first = len(copies.events)
            got.append(run.step(step))
            by_worker.append(sum(ev.by == "tiermem-hybrid-adam"
                                 for ev in copies.events[first:]))
            assert len(copies.events) - first == n_streamed
            assert all(ev.done for ev in copies.events)
        stats = run.stream.stats()
    finally:
        run.close()
    assert_same_steps(got, want, "late copies")
    assert stats["handed_in_pass"] == STEPS * n_streamed and stats["handed_at_end"] == 0
    # step 0 records the trace (step() ships everything after the pass: landed by its end);
    # from then on the worker waited for every streamed gradient's copy itself
    assert by_worker == [0] + [n_streamed] * (STEPS - 1)


@pytest.mark.parametrize("native", [True, False], ids=["native", "fallback"])
def test_streamed_pieces_are_stepped_in_place(stores, one_thread, monkeypatch, native):
    """Note [in-place host chunks]: with the native kernel the CPU kernel steps every piece of a
    streamed weight in place, whatever chunk it is in: it reads no gradient ring slot and
    writes the host copy itself, and the rings carry only the other weights' pieces (with
    torch's fallback kernel, whose split changes bits, only a chunk that is all one streamed
    piece). Counted over 8 steps against the plan's pieces, with ``step_stats``'
    ``in_place_bytes`` / ``ring_copy_bytes``; the run stays bit-identical to the unstreamed
    one (the fallback's too)."""
    from tiermem.optim import chunk_worker, cpu_adam

    if not native:
        monkeypatch.setattr(cpu_adam, "_native_lib", lambda: None)
        monkeypatch.setattr(cpu_adam, "_fallback_warned", True)  # no warning: it is meant
    assert cpu_adam.native_available() == native

    def within(ptr, t):
        return t.data_ptr() <= ptr < t.data_ptr() + t.numel() * t.element_size()

    calls = []
    real = chunk_worker.adam_step_unchecked

    def spy(param, grad, exp_avg, exp_avg_sq, **kw):
        calls.append((grad.data_ptr(), kw["param_out"].data_ptr() + kw["offset"]
                      * kw["param_out"].element_size()))
        return real(param, grad, exp_avg, exp_avg_sq, **kw)

    cfg = CASES["cpu-f1"]
    want = _train(cfg, stores, streamed=False)
    monkeypatch.setattr(chunk_worker, "adam_step_unchecked", spy)
    run = Run(cfg, stores, streamed=True)
    got, stats = [], []
    try:
        for step in range(STEPS):
            got.append(run.step(step))
            stats.append(run.opt.step_stats())
        groups = run.opt._layout.groups
        hosts = [t for g in groups for t in g.host_copies.values()]
        grad_rings = [t for g in groups for t in g.grad_ring]
        out_rings = [t for g in groups for t in g.out_ring]
        chunks = [(g, c) for g in groups for c in g.plan.chunks]
        whole = {(g.index, c.index) for g, c in chunks
                 if len(c.pieces) == 1 and c.pieces[0].param in g.host_copies}
        pieces = [pc for g, c in chunks for pc in c.pieces if pc.param in g.host_copies
                  and (native or (g.index, c.index) in whole)]
        ringed_pieces = [pc for g, c in chunks for pc in c.pieces
                         if pc.param in g.host_copies and (g.index, c.index) not in whole]
    finally:
        run.close()
    assert_same_steps(got, want, "in place")
    assert whole and ringed_pieces  # both kinds of chunk
    in_place = [(gp, op) for gp, op in calls if any(within(op, h) for h in hosts)]
    assert len(in_place) == STEPS * len(pieces)  # one call each: every step, every such piece
    assert not any(any(within(gp, r) for r in grad_rings) for gp, _ in in_place)
    ringed = [op for _, op in calls if any(within(op, r) for r in out_rings)]
    assert len(ringed) + len(in_place) == len(calls)
    nbytes = sum(pc.numel for pc in pieces) * 4  # fp32 gradients
    ring_bytes = 0 if native else sum(pc.numel for pc in ringed_pieces) * 4
    assert [(s["in_place_bytes"], s["ring_copy_bytes"]) for s in stats] == \
        [(nbytes, ring_bytes)] * STEPS
    phases = {"cpu_adam_s", "copy_wait_s", "clip_wait_s", "grad_copy_s", "state_s",
              "write_back_s"}  # Note [worker phases]
    assert all(phases <= s.keys() and min(s[k] for k in phases) >= 0 for s in stats)
