"""HybridAdam steps streamed weights exactly (Note [streamed write-back] in
tiermem/optim/streamed.py, Note [streamed gradient hand-off] in tiermem/stream/grads.py): a
small GPT with its blocks streamed, trained by HybridAdam, gives at every step the same losses,
weights and optimizer state, bit for bit, as a separately built GPT from the same seed trained
by HybridAdam without streaming; checkpoint resume continues bit-identically; a host copy one
step stale (a skipped write-back, a skipped NVMe rewrite) makes the comparison fail."""

from __future__ import annotations

import io

import pytest
import torch

from tiermem.optim.hybrid_adam import HybridAdam
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights

from _stream_train import batches, make_model

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


def _snapshot(model, opt, losses):
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sd = opt.state_dict()
    state = {(i, name): t.clone() for i, st in sd["state"].items() for name, t in st.items()
             if isinstance(t, torch.Tensor)}
    return losses, weights, state


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
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.opt.synchronize()
        return _snapshot(self.model, self.opt, torch.stack(losses).detach())

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


def _same(got, want, what):
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a[0], b[0]), f"{what} step {step}: losses {a[0]} != {b[0]}"
        for k in b[1]:
            assert torch.equal(a[1][k], b[1][k]), f"{what} step {step}: weight {k} differs"
        assert a[2].keys() == b[2].keys()
        for k in b[2]:
            assert torch.equal(a[2][k], b[2][k]), f"{what} step {step}: state {k} differs"
    assert len(got) == len(want)


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
    _same(got, want, name)
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
    _same(got, want[4:], name + " resumed")


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
        _same(got, want, "slip")


def test_stale_nvme_copy_is_caught(stores, one_thread, monkeypatch):
    """With tier='nvme', skip HybridAdam's mark_changed: the NVMe copy stays one step stale."""
    from tiermem.stream.weights import WeightStream

    cfg = CASES["nvme-f1-nvmestate"]
    want = _train(cfg, stores, streamed=False)
    monkeypatch.setattr(WeightStream, "mark_changed", lambda self, param: None)
    got = _train(cfg, stores, streamed=True)
    with pytest.raises(AssertionError, match="step 1"):
        _same(got, want, "slip")


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
    with pytest.raises(RuntimeError, match="optimizer connected already"):
        HybridAdam(model.parameters(), lr=1e-3, chunk_numel=2048)
    with pytest.raises(RuntimeError, match="close\\(\\) the optimizer first"):
        stream.close()
    opt.close()
    stream.close()


class _Event:
    """A fake CUDA event: the copy it marks happens when it completes."""

    def __init__(self, copy):
        self.copy, self.done = copy, False

    def complete(self):
        if not self.done:
            self.copy()
            self.done = True


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
        event.complete()


class _Entry:
    def __init__(self, name):
        self.name, self.acc, self.staging = name, None, None


def test_cuda_hand_off_waits_for_the_landing_and_keeps_backward_order():
    """Note [streamed gradient hand-off] on the CUDA path (fake events): a gradient is handed
    over only once its copies (and a staged micro-batch's add) have landed, in take order."""
    from tiermem.stream.grads import HostGrads

    copies = _Copies()
    grads = HostGrads(copies, pin=False)
    told = []
    grads.sink = lambda e, passes: told.append((e.name, passes, e.acc.clone()))
    a, b, c = _Entry("a"), _Entry("b"), _Entry("c")
    ga, gb, gc = torch.full((3,), 1.5), torch.full((3,), 2.5), torch.full((3,), 3.5)
    grads.take(a, ga)
    grads.take(b, gb, passes=4)
    assert told == []  # nothing landed
    copies.events[0].complete()  # a's copy lands; b's has not
    grads.take(c, gc)
    assert [t[0] for t in told] == ["a"] and torch.equal(told[0][2], ga)
    copies.events[2].complete()  # c landed before b: still told after b
    grads.take(a, ga)  # a second micro-batch of a: staged, added once landed
    assert [t[0] for t in told] == ["a"]
    grads.flush()
    assert [(t[0], t[1]) for t in told] == [("a", 1), ("b", 4), ("c", 1), ("a", 1)]
    assert torch.equal(told[1][2], gb) and torch.equal(told[2][2], gc)
    assert torch.equal(told[3][2], ga + ga)  # told after the staged add
