"""Note [last pass sums on the device] (tiermem/stream/grads.py): with HybridAdam connected and
depth-first gradient accumulation, the pass whose take completes a streamed weight's step
uploads its host gradient beside the block's backward fill, adds the last micro-batch's
gradient there and copies the sum straight back.

Every training run is 8 HybridAdam steps of different batches per micro-batch, compared at
every step (losses, weights, optimizer state), bit for bit, with an independently built GPT
from the same seed trained by the same HybridAdam settings without streaming.

- Exactness and counts: accumulation over 2 and 4 micro-batches, ``offload_fraction`` 1 and
  0.5, HybridAdam's state in RAM and on NVMe, clipping on and off, checkpointed blocks
  (``use_reentrant=False``), the stream's ``tier="nvme"``, ``zero_grad(set_to_none=False)``:
  ``device_sums`` and ``adds_off_thread`` are the counts the schedule implies, the clipped
  steps' streamed norms are all taken on the device, and no sum is left between passes.
- A weight with no gradient in the last micro-batch: its sum is uploaded, dropped unread at
  the pass end, and its gradient is the earlier micro-batches' sum.
- A backward that fails in the last pass after uploads were issued: the host gradients are
  unchanged, no sum is left, and after ``zero_grad`` the stream trains on bit-identically to a
  reference that had the same failure.
- Without a connected optimizer (AdamW over the host gradients; bare backward passes) nothing
  is summed on the device; the adder adds every later micro-batch.
- Must-fail twins: a sum that starts from zeros, or from the previous step's host gradient,
  makes the comparison fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from tiermem.optim.hybrid_adam import HybridAdam
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights
from tiermem.stream.grads import HostGrads

from _stream_train import (CFG, assert_same_run, assert_same_steps, batches, make_model,
                           step_snapshot, train)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster
STEPS = 8


@dataclass(frozen=True)
class Case:
    n_micro: int
    fraction: float = 1.0
    state_tier: str = "cpu"     # HybridAdam's
    clip: float | None = None
    ckpt: bool = False
    tier: str = "cpu"           # the stream's
    to_none: bool = True        # zero_grad(set_to_none=...)


CASES = {
    "df2-f1-clip": Case(2, clip=0.5),
    "df4-f05": Case(4, fraction=0.5),
    "df2-f05-ckpt-clip-zeroed": Case(2, fraction=0.5, clip=0.5, ckpt=True, to_none=False),
    "df4-f1-ckpt-nvme-tier-zeroed": Case(4, ckpt=True, tier="nvme", to_none=False),
    "df2-f1-nvme-state-nvme-tier-clip": Case(2, state_tier="nvme", clip=0.5, tier="nvme"),
    "df4-f05-nvme-state-ckpt-clip-zeroed": Case(4, fraction=0.5, state_tier="nvme", clip=0.5,
                                                ckpt=True, to_none=False),
    # one micro-batch: the take completes the step, but only a zeroed host gradient is there
    "df1-zeroed": Case(1, to_none=False),
}


@pytest.fixture
def stores(make_stream_store):
    """``stores()``: a CPU store, no GPU budget, 16 MiB RAM, a 64 MiB NVMe tier."""
    return lambda: make_stream_store(gpu_bytes=0, nvme_bytes=64 << 20)


class Sometimes(nn.Module):
    """A block with an extra linear layer that runs only while ``on``."""

    def __init__(self, block: nn.Module, d: int) -> None:
        super().__init__()
        self.block, self.extra, self.on = block, nn.Linear(d, d), True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(x)
        return x + self.extra(x) if self.on else x


def _model(case: Case, sometimes: bool) -> nn.Module:
    model = make_model(seed=0, checkpoint=case.ckpt)
    if sometimes:
        torch.manual_seed(1)
        model.blocks[1] = Sometimes(model.blocks[1], CFG.d_model)
    return model


class Run:
    """One HybridAdam run of ``case``; ``streamed``: the blocks' weights streamed (the stream
    built before HybridAdam)."""

    def __init__(self, case: Case, stores, streamed: bool, sometimes: bool = False) -> None:
        self.case = case
        self.model = _model(case, sometimes)
        self.stream = stream_weights(self.model.blocks, store=stores(), tier=case.tier,
                                     prefetch_blocks=1) if streamed else None
        self.opt = HybridAdam(self.model.parameters(), lr=3e-3, weight_decay=0.1,
                              offload_fraction=case.fraction, chunk_numel=2048,
                              max_grad_norm=case.clip, grad_accumulation_steps=case.n_micro,
                              state_tier=case.state_tier,
                              store=stores() if case.state_tier == "nvme" else None)

    def micro_batches(self, step: int, before=None) -> list:
        """Step ``step``'s forward and backward, depth-first; ``before(k)`` runs before
        micro-batch ``k``'s forward. Returns the losses (not divided)."""
        mbs = batches(step, self.case.n_micro)
        losses = []
        for k, (idx, tgt) in enumerate(mbs):
            if before is not None:
                before(k)
            _, loss = self.model(idx, tgt)
            (loss / len(mbs)).backward()
            losses.append(loss.detach())
        return losses

    def snapshot(self, losses: list) -> tuple:
        return step_snapshot(self.model, self.opt, losses, set_to_none=self.case.to_none)

    def close(self) -> None:
        self.opt.close()
        if self.stream is not None:
            self.stream.close()


def _entries(stream) -> list:
    return list(stream._entries.values())


def _no_sum_left(stream) -> None:
    left = [p.name for p in _entries(stream) if p.dev_sum is not None or p.dev_event is not None]
    assert not left and stream._grads._uploaded == [], left


def _expected(case: Case, n_params: int, steps: int = STEPS) -> tuple[int, int]:
    """``(adds_off_thread, device_sums)`` the schedule implies (Note [host gradients], Note
    [last pass sums on the device]): per step each weight's first take goes straight into an
    empty host gradient (``set_to_none=True``, or the first step) or into a zeroed one; every
    take into a host gradient is an add but the last (it completes the step), which is summed
    on the device: with one micro-batch only into a zeroed host gradient."""
    adds = sums = 0
    for step in range(steps):
        held = step > 0 and not case.to_none
        last_held = held or case.n_micro > 1  # a host gradient to upload in the last pass
        sums += last_held
        adds += case.n_micro - last_held - (not held)
    return adds * n_params, sums * n_params


def _train(case, stores, streamed, *, check=None):
    """8 steps of ``case`` through the library's depth-first ``forward_backward``:
    ``(per-step snapshots, stream stats per step, norm counts per step, run)``."""
    run = Run(case, stores, streamed)
    got, stats, norms = [], [], []
    try:
        for step in range(STEPS):
            losses = forward_backward(run.model, batches(step, case.n_micro))
            got.append(run.snapshot(losses))
            if streamed:
                stats.append(dict(run.stream.stats()))
                norms.append(run.opt.step_stats().get("norms_precomputed"))
                _no_sum_left(run.stream)
        return got, stats, norms, run
    finally:
        run.close()


@pytest.mark.parametrize("name", list(CASES))
def test_last_pass_sums_are_bit_identical_and_counted(name, stores):
    case = CASES[name]
    want, _, _, _ = _train(case, stores, streamed=False)
    got, stats, norms, run = _train(case, stores, streamed=True)
    assert_same_steps(got, want, name)
    n_params = sum(1 for _ in run.model.blocks.parameters())
    for step, st in enumerate(stats):  # per step: the counts so far
        assert (st["adds_off_thread"], st["device_sums"]) == _expected(case, n_params, step + 1)
        assert st["add_waits"] == 0  # no staging tensor on the CPU
    if case.clip is not None:  # every streamed norm was taken beside the device sum
        assert norms == [n_params] * STEPS
    moved = [k for k in want[0][1] if k.startswith("blocks.")
             and not torch.equal(want[0][1][k], want[-1][1][k])]
    assert len(moved) == n_params, "every streamed weight trained"


def _track_uploads(monkeypatch) -> list:
    """Record the names of the weights each ``HostGrads.upload`` uploads."""
    uploaded: list = []
    real = HostGrads.upload

    def upload(self, entries):
        before = {id(e) for e in self._uploaded}
        real(self, entries)
        uploaded.extend(f"{e.block.index}.{e.name}" for e in self._uploaded
                        if id(e) not in before)
    monkeypatch.setattr(HostGrads, "upload", upload)
    return uploaded


@pytest.mark.parametrize("n_micro, clip", [(2, None), (4, 0.5)])
def test_a_weight_without_a_last_gradient_keeps_its_earlier_sum(n_micro, clip, stores,
                                                                 monkeypatch):
    """Block 1's extra linear runs in every micro-batch but the last: in the last pass its host
    gradient is uploaded with its block's (its take would complete the step) and never taken;
    the pass end drops it, its ``.grad`` after that backward is the earlier micro-batches' sum
    (the reference's, bit for bit), it is not counted as summed, and training is exact."""
    case = Case(n_micro, clip=clip)
    uploaded = _track_uploads(monkeypatch)
    results = {}
    for streamed in (False, True):
        run = Run(case, stores, streamed, sometimes=True)
        gate = run.model.blocks[1]
        extra = [("extra.weight", gate.extra.weight), ("extra.bias", gate.extra.bias)]
        snaps, grads = [], []
        try:
            for step in range(STEPS):
                losses = run.micro_batches(step, before=lambda k: setattr(
                    gate, "on", k < n_micro - 1))
                grads.append([g.grad.clone() for _, g in extra])
                if streamed:
                    _no_sum_left(run.stream)
                snaps.append(run.snapshot(losses))
            stats = run.stream.stats() if streamed else None
        finally:
            run.close()
        results[streamed] = snaps, grads, stats
    (want, want_grads, _), (got, got_grads, stats) = results[False], results[True]
    assert_same_steps(got, want, "no last gradient")
    for step, (a, b) in enumerate(zip(got_grads, want_grads)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {step}: extra's gradient"
    assert all(g.abs().sum() > 0 for step in want_grads for g in step)
    n_params = sum(1 for _ in _model(case, True).blocks.parameters())
    assert stats["device_sums"] == STEPS * (n_params - 2)  # never extra's
    extra_uploads = [u for u in uploaded if u.startswith("1.block.extra.") or
                     u.startswith("1.extra.")]
    assert len(extra_uploads) == STEPS * 2  # uploaded every last pass, dropped unread


FAIL_STEP, FAIL_BLOCK = 3, 2


def _fail_in_stream(monkeypatch, armed: list, seen: list) -> None:
    """``HostGrads.upload`` raises, once armed, right after issuing blocks[FAIL_BLOCK]'s
    uploads (the stream's backward hook of that block: the pass ends, Note [weight
    streaming]); ``seen`` gets the entries whose sums were on the device then."""
    real = HostGrads.upload

    def upload(self, entries):
        real(self, entries)
        if armed[0] and entries and entries[0].block.index == FAIL_BLOCK:
            armed[0] = False
            seen.extend(e for e in self._uploaded if e.dev_sum is not None)
            raise RuntimeError("injected backward failure after the uploads")
    monkeypatch.setattr(HostGrads, "upload", upload)


def _fail_in_reference(model: nn.Module, armed: list) -> None:
    """The same failure without a stream: a hook on blocks[FAIL_BLOCK]'s output raises when
    its gradient arrives (where the stream's backward hook of that block runs)."""
    def hook(module, args, out):
        if armed[0] and torch._C._current_graph_task_id() == -1:  # the forward, not a recompute
            def fail(grad):
                armed[0] = False
                raise RuntimeError("injected backward failure after the uploads")
            out.register_hook(fail)
    model.blocks[FAIL_BLOCK].register_forward_hook(hook)


def test_a_backward_failing_after_the_uploads_leaves_the_gradients_and_trains_on(
        stores, monkeypatch):
    """Step 3's last micro-batch fails in the backward hook of block 2, after the sums of
    blocks 2 and 1 were uploaded (block 3's were taken and handed over). In both runs: the
    error is raised, the gradients are those of the same partial backward (blocks 2 and 1: the
    first micro-batch's alone, their host gradients unchanged), ``zero_grad`` and ``step()``
    (HybridAdam steps what it was handed, and its accumulation count starts afresh), then the
    remaining steps. The streamed run is bit-identical to the reference at every step, the
    stream's pass has ended with no sum left, and its later steps sum on the device again."""
    case = Case(2, clip=0.5)
    results, seen = {}, []
    for streamed in (False, True):
        run = Run(case, stores, streamed)
        armed = [False]
        if streamed:
            _fail_in_stream(monkeypatch, armed, seen)
        else:
            _fail_in_reference(run.model, armed)
        snaps, after_fail = [], None
        try:
            for step in range(STEPS + 1):
                if step != FAIL_STEP:
                    snaps.append(run.snapshot(run.micro_batches(step)))
                    continue
                with pytest.raises(RuntimeError, match="injected backward failure"):
                    run.micro_batches(step, before=lambda k: armed.__setitem__(
                        0, k == case.n_micro - 1))
                assert not armed[0]  # it failed where it was armed
                after_fail = {n: None if p.grad is None else p.grad.clone()
                              for n, p in run.model.named_parameters()}
                if streamed:
                    assert not run.stream.in_pass
                    _no_sum_left(run.stream)
                    sums_then = run.stream.stats()["device_sums"]
                run.opt.zero_grad(set_to_none=True)
                run.opt.step()  # nothing more to add: what was handed over is stepped
                run.opt.synchronize()
            stats = run.stream.stats() if streamed else None
        finally:
            run.close()
        results[streamed] = snaps, after_fail, stats
    (want, want_fail, _), (got, got_fail, stats) = results[False], results[True]
    assert want_fail.keys() == got_fail.keys()
    for k, b in want_fail.items():
        a = got_fail[k]
        assert (a is None) == (b is None) and (b is None or torch.equal(a, b)), k
    n_block = sum(1 for _ in make_model().blocks[0].parameters())
    assert sorted({e.block.index for e in seen}) == [FAIL_BLOCK - 1, FAIL_BLOCK]
    # the untaken sums' host gradients: the first micro-batch's alone, as in the reference
    assert all(got_fail[f"blocks.{e.block.index}.{e.name}"] is not None for e in seen)
    assert_same_steps(got, want, "after a failed last pass")
    assert sums_then == FAIL_STEP * 4 * n_block + n_block  # block 3's sums were taken
    assert stats["device_sums"] == sums_then + (STEPS + 1 - FAIL_STEP - 1) * 4 * n_block


@pytest.mark.parametrize("n_micro", [2, 4])
def test_without_a_connected_optimizer_nothing_is_summed_on_the_device(n_micro, stores):
    """AdamW steps the host gradients (no link): the stream never asks to upload, the adder
    adds every later micro-batch, and training is the unstreamed loop's bit for bit."""
    want = train(make_model(seed=0), n_micro=n_micro)
    held = {}

    def start(model):
        held["s"] = stream_weights(model.blocks, store=stores(), prefetch_blocks=1)
        return held["s"]
    losses, weights, stream = train(make_model(seed=0), n_micro=n_micro, stream=start)
    try:
        assert stream._grads.completes is None
        st = stream.stats()
        n_params = sum(1 for _ in stream._entries)
        assert st["device_sums"] == 0
        assert st["adds_off_thread"] == STEPS * (n_micro - 1) * n_params
    finally:
        stream.close()
    assert_same_run((losses, weights), want[:2], "AdamW")


def test_bare_backward_passes_sum_on_the_host(stores, monkeypatch):
    """Backward passes with no optimizer at all: 3 micro-batches accumulate the unstreamed
    gradients bit for bit, no upload is issued."""
    uploaded = _track_uploads(monkeypatch)
    ref, model = make_model(seed=0), make_model(seed=0)
    forward_backward(ref, batches(0, 3))
    with stream_weights(model.blocks, store=stores(), prefetch_blocks=1) as stream:
        forward_backward(model, batches(0, 3))
        st = stream.stats()
        for (k, a), b in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(a.grad, b.grad), k
    assert st["device_sums"] == 0 and uploaded == []
    assert st["adds_off_thread"] == 2 * sum(1 for _ in model.blocks.parameters())


def _bad_upload(monkeypatch, how: str) -> None:
    """``HostGrads.upload`` whose sums start from zeros, or from the host gradient this weight
    had at its previous step's upload (a one-step-stale copy)."""
    real, stale = HostGrads.upload, {}

    def upload(self, entries):
        before = {id(e) for e in self._uploaded}
        real(self, entries)
        for e in self._uploaded:
            if id(e) in before:
                continue
            now = e.acc.clone()
            if how == "zeros":
                e.dev_sum.zero_()
            elif id(e) in stale:
                e.dev_sum.copy_(stale[id(e)])
            stale[id(e)] = now
    monkeypatch.setattr(HostGrads, "upload", upload)


@pytest.mark.parametrize("how", ["zeros", "stale"])
def test_the_comparison_fails_when_the_sum_does_not_start_from_the_host_gradient(
        how, stores, monkeypatch):
    """Must-fail twin: the device sum starts from zeros (the earlier micro-batches lost) or
    from the previous step's host gradient; the sums are still made and counted, and the
    comparison with the unstreamed run fails."""
    case = CASES["df4-f05"]
    want, _, _, _ = _train(case, stores, streamed=False)
    _bad_upload(monkeypatch, how)
    got, stats, _, run = _train(case, stores, streamed=True)
    n_params = sum(1 for _ in run.model.blocks.parameters())
    assert stats[-1]["device_sums"] == STEPS * n_params
    with pytest.raises(AssertionError, match="differs|losses"):
        assert_same_steps(got, want, how)
