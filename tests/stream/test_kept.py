"""What a weight stream fetches and when, as decisions and counts: the last blocks kept from the
forward into the backward (Note [kept into backward] in tiermem/stream/residency.py), the order
in which fills are issued against the blocks' compute, which copy stream waits on which event
(a recording stand-in for ``torch.cuda`` on this CPU-only machine), and on CUDA (marked) that a
fill lands while the block before it computes (the compute stream sleeping; no timed
assertion: the copy is seen landed while the compute has not finished)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from _stream_train import batches, make_model

from tiermem import StoreConfig, TierStore
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights
from tiermem.stream.copies import StreamCopies

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster


@pytest.fixture
def kstore():
    s = TierStore(StoreConfig(device="cpu", gpu_bytes=1 << 20, cpu_bytes=8 << 20,
                              pool_slab_bytes=1 << 20))
    yield s
    s.close()


def _record(h, log):
    """Log each real fill (``("fill", block)``) and each backward reaching a block."""
    fill, pre_backward = h._fetcher.fill, h._pre_backward

    def logged_fill(block):
        if block.state == "released":
            log.append(("fill", block.index))
        fill(block)

    def logged_pre_backward(i, token):
        log.append(("backward", i))
        pre_backward(i, token)

    h._fetcher.fill = logged_fill
    h._pre_backward = logged_pre_backward
    for i, block in enumerate(h.modules):  # after the stream's pre-hook: the block computes
        block.register_forward_pre_hook(lambda m, a, i=i: log.append(("forward", i)))


@pytest.mark.parametrize("prefetch,expected_backward", [
    (1, [("backward", 3), ("backward", 2), ("backward", 1), ("fill", 0), ("backward", 0)]),
    (0, [("backward", 3), ("backward", 2), ("backward", 1), ("fill", 1), ("backward", 0),
         ("fill", 0)]),
])
def test_fills_are_issued_ahead_and_the_last_blocks_are_not_fetched_again(
        kstore, prefetch, expected_backward):
    """prefetch 1: each forward fill is issued before the block before it computes; blocks
    1-3 stay from the forward into the backward, whose only fill (block 0) is issued when the
    backward reaches block 1. prefetch 0: blocks 2-3 stay; 5 or 6 fills instead of 8."""
    model = make_model()
    h = stream_weights(model.blocks, store=kstore, prefetch_blocks=prefetch)
    assert h.plan.kept == ((1, 2, 3) if prefetch else (2, 3))
    log: list = []
    _record(h, log)
    idx, targets = batches(0, 1)[0]
    _, loss = model(idx, targets)
    if prefetch:
        assert log == [("fill", 0), ("fill", 1), ("forward", 0), ("fill", 2), ("forward", 1),
                       ("fill", 3), ("forward", 2), ("forward", 3)]
    else:
        assert log == [x for i in range(4) for x in (("fill", i), ("forward", i))]
    # the kept blocks are on the device between the forward and the backward, the rest not
    assert [b.state for b in h._blocks] == ["released"] + ["released" if i not in h.plan.kept
                                                           else "ready" for i in (1, 2, 3)]
    del log[:]
    loss.backward()
    assert log == expected_backward
    assert h.stats()["fills"] == 8 - len(h.plan.kept)
    assert h.stats()["peak_blocks"] <= h.plan.buffer_blocks
    assert h._fetcher.materialized == 0 and not h.in_pass
    h.close()


def test_a_forward_without_a_backward_keeps_nothing(kstore):
    """Under no_grad every block leaves after its forward (no backward will need it); a forward
    whose outputs are dropped leaves its kept blocks until the next pass settles it."""
    model = make_model()
    h = stream_weights(model.blocks, store=kstore)
    idx, targets = batches(0, 1)[0]
    with torch.no_grad():
        model(idx, targets)
    assert not h.in_pass and h._fetcher.materialized == 0
    assert h.stats()["fills"] == 4 and h.stats()["peak_blocks"] <= 2  # prefetch 1: 2 at once
    model(idx, targets)  # a graph, dropped at once: its kept blocks wait for the next pass
    forward_backward(model, batches(1, 1))
    assert h.stats()["fills"] == 4 + 4 + 5 and h._fetcher.materialized == 0
    h.close()


def test_a_kept_block_changed_in_place_during_the_pass_is_refused(kstore):
    """A kept block is not fetched again, so the fill's check cannot see an in-place change
    between the forward and the backward; ``ready`` checks it (the backward would use weights
    the forward did not). The pass ends and the stream stays usable."""
    model = make_model()
    h = stream_weights(model.blocks, store=kstore)
    idx, targets = batches(0, 1)[0]
    _, loss = model(idx, targets)
    with torch.no_grad():
        model.blocks[3].ln1.bias.add_(1.0)  # block 3 is kept (and its bias is not saved)
    with pytest.raises(RuntimeError, match=r"blocks\[3\]\.ln1\.bias was changed in place"):
        loss.backward()
    assert not h.in_pass and h._fetcher.materialized == 0
    forward_backward(model, batches(1, 1))
    h.close()


# ------------------------------------------------------------------ the copy streams' events


class _Event:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


class _Stream:
    def __init__(self, name, log):
        self.name, self.log, self.n = name, log, 0

    def record_event(self):
        self.n += 1
        ev = _Event(f"{self.name}#{self.n}")
        self.log.append(("record", self.name, ev.name))
        return ev

    def wait_event(self, ev):
        self.log.append(("wait", self.name, ev.name))


class _FakeCuda:
    """The parts of ``torch.cuda`` that tiermem/stream/copies.py calls, recording."""

    def __init__(self, monkeypatch):
        self.log: list = []
        self.compute = _Stream("compute", self.log)
        self.current = self.compute
        made = iter(["h2d", "d2h"])
        monkeypatch.setattr(torch.cuda, "Stream", lambda device: _Stream(next(made), self.log))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "stream", self._stream)
        monkeypatch.setattr(torch.cuda, "_sleep", lambda n: self.log.append(("sleep", n)))

    @contextlib.contextmanager
    def _stream(self, s):
        before, self.current = self.current, s
        try:
            yield
        finally:
            self.current = before


class _Tensor:
    def __init__(self, name, cuda):
        self.name, self.cuda = name, cuda

    def copy_(self, src, non_blocking=False):
        self.cuda.log.append(("copy", self.cuda.current.name, src.name, self.name, non_blocking))

    def record_stream(self, s):
        self.cuda.log.append(("record_stream", self.name, s.name))


def test_each_copy_stream_waits_only_on_the_event_that_orders_it(monkeypatch):
    """A fill: the H2D stream waits for the compute stream's event recorded at the fill (its
    memory, just allocated on the compute stream, may still be read by queued kernels) and for
    nothing later, copies non-blocking on the H2D stream, and hands back its own event, which
    only the compute stream waits on (``use``). A gradient: the D2H stream (not the H2D one)
    waits for the compute event at the hand-off, copies non-blocking, and the allocator is
    told the D2H stream reads the gradient (no host synchronization anywhere)."""
    cuda = _FakeCuda(monkeypatch)
    copies = StreamCopies(torch.device("cuda"))
    assert copies.cuda and copies.h2d_stream is not copies.d2h_stream
    w = [(_Tensor(f"dev{k}", cuda), _Tensor(f"host{k}", cuda)) for k in range(2)]
    landed = copies.fill(w)
    assert landed.name == "h2d#1"
    assert cuda.log == [("record", "compute", "compute#1"), ("wait", "h2d", "compute#1"),
                        ("copy", "h2d", "host0", "dev0", True),
                        ("copy", "h2d", "host1", "dev1", True), ("record", "h2d", "h2d#1")]
    del cuda.log[:]
    copies.use(landed)
    assert cuda.log == [("wait", "compute", "h2d#1")]
    del cuda.log[:]
    done = copies.grad_out(_Tensor("host_grad", cuda), _Tensor("grad", cuda))
    assert done.name == "d2h#1"
    assert cuda.log == [("record", "compute", "compute#2"), ("wait", "d2h", "compute#2"),
                        ("copy", "d2h", "grad", "host_grad", True), ("record", "d2h", "d2h#1"),
                        ("record_stream", "grad", "d2h")]


# ------------------------------------------------------------------ CUDA: overlap, shown

SLEEP_CYCLES = 2_000_000_000  # ~1 s of one SM's clock: far longer than a 100 KB copy


def _landed_while_computing(h, j):
    """On the compute stream: sleep (the block computing), then wait on the host until either
    blocks[j]'s fill has landed or the sleep is over; True when the fill landed first."""
    block = h._blocks[j]
    assert block.state == "filling" and block.event is not None  # issued before the compute
    torch.cuda._sleep(SLEEP_CYCLES)
    computed = torch.cuda.current_stream().record_event()
    while True:
        if block.event.query():
            return not computed.query()
        if computed.query():
            return False


@pytest.mark.cuda
def test_a_fill_lands_while_the_block_before_it_computes(tmp_path):
    """prefetch 1: blocks[2]'s fill, issued before blocks[1] computes, lands while blocks[1]'s
    compute (a sleep) is still running; in the backward blocks[0]'s fill, issued when the
    backward reaches blocks[1], lands while blocks[1]'s backward (a sleep) runs. Host copies
    and host gradients are pinned (a pageable H2D copy would be synchronous)."""
    device = torch.device("cuda")
    model = make_model(torch.bfloat16).to(device)
    with TierStore(StoreConfig(device="cuda", gpu_bytes=1 << 20, cpu_bytes=8 << 20,
                               pool_slab_bytes=1 << 20)) as store:
        h = stream_weights(model.blocks, store=store, prefetch_blocks=1)
        assert all(p.host.is_pinned() for b in h._blocks for p in b.params)
        seen = {}
        model.blocks[1].register_forward_pre_hook(
            lambda m, a: seen.__setitem__("forward", _landed_while_computing(h, 2)))

        def after_stream_hook(m, a, out):  # registered after the stream's: runs after it
            out.register_hook(lambda g: seen.__setitem__("backward",
                                                         _landed_while_computing(h, 0)))

        model.blocks[1].register_forward_hook(after_stream_hook)
        idx, targets = batches(0, 1)[0]
        _, loss = model(idx.to(device), targets.to(device))
        loss.backward()
        torch.cuda.synchronize()
        assert seen == {"forward": True, "backward": True}
        assert all(p.param.grad.is_pinned() for b in h._blocks for p in b.params)
        assert h.stats()["fills"] == 8 - 3
        h.close()


# ------------------------------------------------------------------ gradient hand-off


class _Copy:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done


class _GradCopies:
    """HostGrads' view of the copy streams on CUDA: each D2H copy's event lands only when the
    test says so (``landed`` is the host waiting for it)."""

    cuda = True

    def __init__(self):
        self.events: list = []

    def grad_out(self, dst, src):
        dst.copy_(src)
        self.events.append(_Copy())
        return self.events[-1]

    @staticmethod
    def finished(event):
        return event.done

    @staticmethod
    def landed(event):
        event.done = True


def test_a_gradient_reaches_the_optimizer_at_its_take_with_its_copy_event():
    """Note [hand-off lag], the fix: on CUDA a gradient copied straight into its host gradient
    is handed to the sink at its take, with its copy's event while that is in flight, not at
    a later take or flush() after it landed; the counts say so."""
    from types import SimpleNamespace

    from tiermem.stream.grads import HostGrads

    copies = _GradCopies()
    grads = HostGrads(copies, pin=False)
    told = []
    grads.sink = lambda entry, passes, event: told.append((entry.name, event))
    entries = [SimpleNamespace(name=f"w{k}", acc=None, staging=None, dev_sum=None) for k in range(3)]
    grads.take(entries[0], torch.ones(4))
    grads.take(entries[1], torch.ones(4))
    assert told == [("w0", copies.events[0]), ("w1", copies.events[1])]  # in flight
    copies.events[0].done = True
    grads.take(entries[2], torch.ones(4))
    assert told[2] == ("w2", copies.events[2])
    grads.flush()
    assert len(told) == 3
    assert grads.handed == {"handed_in_pass": 3, "handed_at_end": 0}


def test_an_unpinned_store_on_cuda_is_warned_about():
    """Note [pinned host copies]: on a CUDA device only StoreConfig.pin_memory=False leaves the
    stream's host memory pageable (its copies then serialize with compute); 'auto' and True
    pin, and a CPU device has nothing to pin."""
    from types import SimpleNamespace

    from tiermem.stream.checks import unpinned_warning

    def store(device, pin):
        return SimpleNamespace(device=torch.device(device),
                               config=SimpleNamespace(pin_memory=pin))

    assert "pin_memory=False" in unpinned_warning(store("cuda", False))
    assert unpinned_warning(store("cuda", "auto")) is None
    assert unpinned_warning(store("cuda", True)) is None
    assert unpinned_warning(store("cpu", False)) is None
