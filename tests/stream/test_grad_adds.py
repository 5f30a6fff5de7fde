"""Note [gradient adder] (tiermem/stream/grad_adds.py): a later micro-batch's streamed gradient
is added into its host gradient on the stream's adder thread, not on the autograd thread.

- Exactness: a small GPT with its blocks streamed, trained 8 steps by HybridAdam, gives at every
  step the same losses, weights and optimizer state, bit for bit, as an independently built GPT
  from the same seed trained by the same HybridAdam without streaming: depth-first accumulation
  over 2-4 micro-batches and block-major passes accumulated on the host (2 passes per step),
  ``offload_fraction`` 1 and 0.5, clipping on and off, ``rollback_bytes`` 0 and > 0,
  ``zero_grad(set_to_none=False)``, and the staging tensor of the CUDA path run on the CPU
  (``stage_on_cpu``); the adds counted are the ones the schedule makes, and no adder thread is
  left between passes.
- The autograd thread is not blocked: an add held until the last take of its pass does not
  hold that take back.
- An add that fails on the adder thread is raised on the caller's thread (at the next take or
  the pass end) naming its parameter; the stream stays usable and trains on bit-identically.
- Must-fail twins: a flush that does not wait for the adds, and a take that does not wait for
  the previous add of its staging tensor, make the comparison fail.
"""

from __future__ import annotations

import threading

import pytest
import torch

import tiermem.stream.grad_adds as grad_adds
from tiermem.optim.hybrid_adam import HybridAdam
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights
from tiermem.stream.grad_adds import GradAdder
from tiermem.stream.grads import HostGrads

from _stream_train import assert_same_steps, batches, make_model, step_snapshot

STEPS = 8
GUARD_S = 60  # deadlock guard of the held adds (never reached when the code is right)

# name -> micro-batches, passes per step, block-major, offload_fraction, max_grad_norm,
# rollback_bytes, zero_grad(set_to_none), stage_on_cpu
CASES = {
    "df2-f1": (2, 1, False, 1.0, None, 0, True, False),
    "df3-f05-clip": (3, 1, False, 0.5, 0.5, 0, True, False),
    "df4-f1-clip-rollback": (4, 1, False, 1.0, 0.5, 1 << 30, True, False),
    "df2-f05-clip-rollback-zeroed": (2, 1, False, 0.5, 0.5, 1 << 30, False, False),
    "df2-f1-staged": (2, 1, False, 1.0, None, 0, True, True),
    "bm2x2-f1-clip": (2, 2, True, 1.0, 0.5, 0, True, False),
    "bm2x2-f05-rollback-staged": (2, 2, True, 0.5, 0.5, 1 << 30, True, True),
    "bm2x2-f05-staged-zeroed": (2, 2, True, 0.5, None, 0, False, True),
}


@pytest.fixture
def stores(make_stream_store):
    """``stores()``: a CPU store, no GPU budget, 8 MiB RAM."""
    return lambda: make_stream_store(gpu_bytes=0, cpu_bytes=8 << 20)


class Run:
    """One training run of case ``cfg``; ``streamed``: the blocks' weights streamed."""

    def __init__(self, cfg, stores, streamed):
        n_micro, passes, major, fraction, clip, rollback, to_none, _ = cfg
        self.cfg = cfg
        self.model = make_model(seed=0)
        self.stream = stream_weights(self.model.blocks, store=stores(), prefetch_blocks=1) \
            if streamed else None
        self.opt = HybridAdam(self.model.parameters(), lr=3e-3, weight_decay=0.1,
                              offload_fraction=fraction, chunk_numel=2048, max_grad_norm=clip,
                              grad_accumulation_steps=n_micro * passes, rollback_bytes=rollback)

    def step(self, step):
        n_micro, passes, major, *_, to_none, _ = self.cfg
        losses = []
        for k in range(passes):
            losses += forward_backward(self.model, batches(step * passes + k, n_micro),
                                       block_major=major)
        return step_snapshot(self.model, self.opt, losses, set_to_none=to_none)

    def close(self):
        self.opt.close()
        if self.stream is not None:
            self.stream.close()


def _train(cfg, stores, streamed, check=None):
    run = Run(cfg, stores, streamed)
    try:
        got = []
        for s in range(STEPS):
            got.append(run.step(s))
            if check is not None:
                check(run)
        return got, (run.stream.stats() if streamed else None), run
    finally:
        run.close()


def _same(got, want, what):
    assert len(want) == STEPS
    assert_same_steps(got, want, what)


def _expected_adds(cfg, n_params):
    """Host adds and device sums the schedule makes (Note [host gradients], Note [block-major
    passes], Note [last pass sums on the device]): per pass, a take into a host gradient that
    is not None is an add; depth-first takes once per micro-batch, block-major once per pass
    when the pass begins with no host gradient (device accumulation) else once per
    micro-batch; a depth-first take that completes the step into a held host gradient is
    summed on the device instead (HybridAdam is connected)."""
    n_micro, passes, major, *_, to_none, _ = cfg
    adds = sums = 0
    for step in range(STEPS):
        held = step > 0 and not to_none  # zero_grad(set_to_none=False) keeps host gradients
        for _ in range(passes):
            if major:
                adds += n_micro if held else 0
            else:
                adds += n_micro - 1 if held else n_micro - 2
                sums += 1  # every depth-first case has n_micro >= 2: the last take is held
            held = True
    return adds * n_params, sums * n_params


@pytest.fixture
def staged(monkeypatch):
    """``staged(on)``: HostGrads copies later micro-batches into the staging tensor on the CPU
    (the CUDA path's staging reuse rule runs, Note [gradient adder])."""
    return lambda on: monkeypatch.setattr(HostGrads, "stage_on_cpu", on)


@pytest.mark.parametrize("name", list(CASES))
def test_adds_on_the_adder_thread_are_bit_identical(name, stores, staged, one_thread):
    cfg = CASES[name]
    want, _, _ = _train(cfg, stores, streamed=False)
    staged(cfg[-1])
    left = []
    got, stats, run = _train(cfg, stores, streamed=True,
                             check=lambda run: left.append(run.stream._grads._adder._thread))
    _same(got, want, name)
    n_params = sum(1 for b in run.model.blocks for _ in b.parameters())
    assert (stats["adds_off_thread"], stats["device_sums"]) == _expected_adds(cfg, n_params)
    if not cfg[-1]:
        assert stats["add_waits"] == 0  # no staging tensor on the CPU: nothing is reused
    assert left == [None] * STEPS  # the thread ends with each pass
    moved = [k for k in want[0][1] if k.startswith("blocks.")
             and not torch.equal(want[0][1][k], want[-1][1][k])]
    assert moved, "the streamed weights moved"


def _gated_add(gate, log):
    """An ``add_into`` that logs and, while ``gate`` is not set, waits for it (a deadlock
    guard ends the wait; ``log`` then says so)."""
    real = grad_adds.add_into

    def add(acc, grad):
        log.append(("add", threading.current_thread().name))
        if not gate.wait(GUARD_S):
            log.append(("timeout", None))
            gate.set()  # one guard's wait, not one per add
        real(acc, grad)
        log.append(("added", None))
    return add


def test_the_autograd_thread_is_not_blocked_by_the_adds(stores, monkeypatch, one_thread):
    """Every add of a pass is held until the last streamed gradient of that pass has been
    taken: the takes go on meanwhile (on the old code the first add, on the autograd thread,
    waited for a take that could only come after it: the guard timed out). The gradients are
    still the unstreamed loop's, bit for bit."""
    ref = make_model(seed=0)
    forward_backward(ref, batches(0, 2))
    model = make_model(seed=0)
    gate, log = threading.Event(), []
    monkeypatch.setattr(grad_adds, "add_into", _gated_add(gate, log))
    real_take = HostGrads.take
    stream = stream_weights(model.blocks, store=stores(), prefetch_blocks=1)
    n_params = sum(1 for b in model.blocks for _ in b.parameters())
    takes = []

    def take(self, entry, grad, passes=1):
        real_take(self, entry, grad, passes)
        takes.append(entry.name)
        log.append(("take", threading.current_thread().name))
        if len(takes) == 2 * n_params:  # the last take of the second micro-batch
            gate.set()
    monkeypatch.setattr(HostGrads, "take", take)
    try:
        forward_backward(model, batches(0, 2))
    finally:
        gate.set()
        stream.close()
    assert ("timeout", None) not in log, "an add blocked the takes after it"
    adds = [k for k, (what, _) in enumerate(log) if what == "add"]
    assert len(adds) == n_params and all(log[k][1] == "tiermem-grad-adder" for k in adds)
    first_added = log.index(("added", None))
    takes_before = sum(what == "take" for what, _ in log[:first_added])
    assert takes_before == 2 * n_params  # every take ran while the first add was held
    assert all(who != "tiermem-grad-adder" for what, who in log if what == "take")
    for (k, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad), f"gradient of {k} differs"


def _failing_add(stream, when, failed):
    """An ``add_into`` whose call number ``when`` raises, recording the name of the
    parameter whose host gradient it was given."""
    real = grad_adds.add_into
    calls = [0]

    def add(acc, grad):
        calls[0] += 1
        if calls[0] == when:
            failed.extend(p.name for p in stream._entries.values() if p.acc is acc)
            raise RuntimeError("injected add failure")
        real(acc, grad)
    return add


def _adamw_loop(model, steps, fail_step=None, on_fail=None):
    """8 depth-first steps of 2 micro-batches with AdamW; step ``fail_step`` runs its
    forward/backward (expected to raise with a streamed model: ``on_fail(exc)``) and is not
    applied: its gradients are zeroed."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    snaps = []
    for step in range(steps):
        if step == fail_step:
            try:
                forward_backward(model, batches(step, 2))
            except RuntimeError as exc:
                on_fail(exc)
            opt.zero_grad(set_to_none=True)
        else:
            losses = forward_backward(model, batches(step, 2))
            opt.step()
            opt.zero_grad(set_to_none=True)
            snaps.append((step, torch.stack(losses).detach()))
        snaps.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return snaps


@pytest.mark.parametrize("where", ["take", "flush"])
def test_a_failed_add_is_raised_naming_its_parameter_and_the_stream_stays_usable(
        where, stores, monkeypatch, one_thread):
    """The first add of step 3's second micro-batch fails (``where="take"``: raised at the
    take after it, once the adder has recorded it) or its last one (``"flush"``: no take comes
    after it; raised at the pass end). The error names the parameter; the pass has ended
    (host copies back, no pass open); the step is skipped (gradients zeroed) and the
    remaining steps are bit-identical to the unstreamed loop that skips it too."""
    fail_step = 3
    want = _adamw_loop(make_model(seed=0), STEPS, fail_step, on_fail=lambda exc: None)
    model = make_model(seed=0)
    stream = stream_weights(model.blocks, store=stores(), prefetch_blocks=1)
    n_params = sum(1 for b in model.blocks for _ in b.parameters())
    real_take = HostGrads.take
    failed, errors = [], []
    armed = [False]

    def take(self, entry, grad, passes=1):
        if armed[0]:
            self._adder.wait_idle()  # the failed add is recorded before this take
        real_take(self, entry, grad, passes)

    # one add per weight and step (the second micro-batch's): step 3's first or last one
    n = fail_step * n_params + (1 if where == "take" else n_params)
    monkeypatch.setattr(grad_adds, "add_into", _failing_add(stream, n, failed))
    armed[0] = where == "take"
    monkeypatch.setattr(HostGrads, "take", take)

    def on_fail(exc):
        errors.append(exc)
        assert not stream.in_pass
    try:
        got = _adamw_loop(model, STEPS, fail_step, on_fail)
    finally:
        stream.close()
    assert len(errors) == 1 and len(failed) == 1, (errors, failed)
    msg = str(errors[0])
    assert f".{failed[0]} failed on the gradient adder thread" in msg
    assert "injected add failure" in msg and "zero them" in msg
    _same_loop(got, want)


def _same_loop(got, want):
    """``_adamw_loop``'s snapshots are bit-identical."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        if isinstance(b, tuple):
            assert a[0] == b[0] and torch.equal(a[1], b[1]), f"step {b[0]}: losses differ"
        else:
            for k in b:
                assert torch.equal(a[k], b[k]), f"weight {k} differs"


def test_a_failed_hand_off_on_the_adder_thread_is_raised_at_the_next_take():
    """A sink that raises on the adder thread (after the add): the next take raises it on the
    caller's thread, naming the parameter, before it changes anything; that parameter is
    handed over no more in the pass, the others are, and flush() then ends the thread."""
    from types import SimpleNamespace

    from tiermem.stream.copies import StreamCopies

    grads = HostGrads(StreamCopies(torch.device("cpu")), pin=False)
    a, b = (SimpleNamespace(name=n, acc=None, staging=None, dev_sum=None) for n in ("a", "b"))
    told = []

    def sink(entry, passes, event):
        if entry is a and entry.acc[0] > 1:
            raise ValueError("sink says no")
        told.append((entry.name, float(entry.acc[0])))
    grads.sink = sink
    grads.take(a, torch.ones(3))  # straight: handed at once on this thread
    grads.take(a, torch.ones(3))  # staged: added, then handed, on the adder thread
    grads._adder.wait_idle()
    with pytest.raises(RuntimeError, match=r"the hand-off to the optimizer of a failed on the "
                                           r"gradient adder thread: ValueError: sink says no"):
        grads.take(b, torch.ones(3))
    assert b.acc is None and torch.equal(a.acc, torch.full((3,), 2.0))
    grads.take(b, torch.ones(3))  # usable: raised once
    grads.take(a, torch.ones(3))  # a failed this pass: added, not handed over
    grads.flush()
    assert told == [("a", 1.0), ("b", 1.0)] and torch.equal(a.acc, torch.full((3,), 3.0))
    assert grads._adder._thread is None
    grads.raise_failed()  # nothing left to raise


def test_the_comparison_fails_when_flush_does_not_wait_for_the_adds(
        stores, monkeypatch, one_thread):
    """Must-fail twin: flush() waits for nothing, and each step's adds are held until its
    optimizer step has run (then run before the next step begins); the steps use gradients
    without their second micro-batch, and the comparison with the unstreamed loop fails.
    (AdamW: no sink, so the late adds change nothing but the values.)"""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    want = _adamw_loop(make_model(seed=0), STEPS)
    model = make_model(seed=0)
    stream = stream_weights(model.blocks, store=stores(), prefetch_blocks=1)
    adder = stream._grads._adder
    gate, log = threading.Event(), []
    monkeypatch.setattr(grad_adds, "add_into", _gated_add(gate, log))
    monkeypatch.setattr(GradAdder, "drain", lambda self: None)

    def after_step(opt, args, kwargs):
        gate.set()  # the step has used the gradients: the held adds run now
        adder.wait_idle()
        gate.clear()
    handle = register_optimizer_step_post_hook(after_step)
    try:
        got = _adamw_loop(model, STEPS)
    finally:
        handle.remove()
        gate.set()
        thread = adder._thread
        adder.stop()  # never drained: end its thread here
        stream.close()
    thread.join(GUARD_S)
    assert ("timeout", None) not in log and not thread.is_alive()
    assert sum(what == "added" for what, _ in log) == STEPS * len(stream._entries)
    with pytest.raises(AssertionError, match="differ"):
        _same_loop(got, want)


def test_the_comparison_fails_when_a_reused_staging_tensor_is_not_waited_for(
        stores, staged, monkeypatch, one_thread):
    """Must-fail twin: block-major passes accumulated on the host take each weight once per
    micro-batch into one staging tensor; with the adds held until the pass ends and the take
    not waiting for the previous add, the second copy overwrites the first before it is added,
    and the comparison fails."""
    cfg = CASES["bm2x2-f05-rollback-staged"]
    want, _, _ = _train(cfg, stores, streamed=False)
    staged(True)
    gate, log = threading.Event(), []
    monkeypatch.setattr(grad_adds, "add_into", _gated_add(gate, log))
    monkeypatch.setattr(GradAdder, "wait_for", lambda self, entry: False)
    real_flush = HostGrads.flush

    def flush(self):
        gate.set()  # the pass ends: the held adds run now
        try:
            real_flush(self)
        finally:
            gate.clear()
    monkeypatch.setattr(HostGrads, "flush", flush)
    got, _, _ = _train(cfg, stores, streamed=True)
    assert ("timeout", None) not in log
    with pytest.raises(AssertionError, match="differs|losses"):
        _same(got, want, "staging reused before its add")


def test_the_adders_seconds_and_bytes_are_counted(monkeypatch):
    """Note [adder seconds]: takes copied straight into an empty host gradient add nothing and
    start no thread (no bytes, no seconds); the later takes' adds are counted with their bytes,
    and a pass end that waits for an add held on the adder thread counts that wait (its lower
    bound is causal: the add is released 0.1 s after the drain began) as ``end_wait_s``, within
    ``add_wait_s``."""
    from types import SimpleNamespace

    from tiermem.stream.copies import StreamCopies

    grads = HostGrads(StreamCopies(torch.device("cpu")), pin=False)
    a, b = (SimpleNamespace(name=n, acc=None, staging=None, dev_sum=None) for n in ("a", "b"))
    gate = threading.Event()
    real = grad_adds.add_into

    def held(acc, grad):
        assert gate.wait(GUARD_S)
        real(acc, grad)
    monkeypatch.setattr(grad_adds, "add_into", held)
    grads.take(a, torch.ones(3))
    grads.take(b, torch.ones(5, dtype=torch.float64))
    st = grads.stats()
    assert st["added_bytes"] == st["adds_off_thread"] == 0
    assert st["adder_busy_s"] == st["add_wait_s"] == st["end_wait_s"] == 0.0
    grads.take(a, torch.ones(3))
    grads.take(b, torch.ones(5, dtype=torch.float64))

    def open_gate():
        while not grads._adder._flushing:  # the drain has begun
            threading.Event().wait(0.001)
        threading.Event().wait(0.1)
        gate.set()
    opener = threading.Thread(target=open_gate)
    opener.start()
    grads.flush()
    opener.join()
    st = grads.stats()
    assert st["adds_off_thread"] == 2 and st["added_bytes"] == 3 * 4 + 5 * 8
    assert st["add_waits"] == 0 and st["end_wait_s"] == st["add_wait_s"] >= 0.05
    assert st["adder_busy_s"] > 0 and st["adder_copy_wait_s"] >= 0
    assert torch.equal(a.acc, torch.full((3,), 2.0))
    assert torch.equal(b.acc, torch.full((5,), 2.0, dtype=torch.float64))
