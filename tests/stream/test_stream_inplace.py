"""A streamed weight changed in place behind autograd's back (``param.data.mul_(...)``: ``.data``
is a tensor with a version counter of its own, so ``param._version`` does not move) is never
silently lost or half applied (issue 29 item 7, Note [streamed weight checksums] in
tiermem/stream/checksums.py).

- Between passes ``param.data`` is the host copy: the next forward streams the change, with
  ``tier="nvme"`` too (its store copy is rewritten when the host copy's checksum moved), and
  HybridAdam takes it into its masters as unstreamed (Note [streamed write-back checksums] in
  tiermem/optim/param_sums.py).
- During a pass the change lands in the block's device buffer, which the stream refills from the
  host copy or drops: refused with one line naming the weight when the block is released, the
  pass ended, the change discarded and the stream usable.

Every run trains 8 AdamW (or HybridAdam) steps of different batches and is compared bit for bit,
at every step and in the final weights, with an independent unstreamed run from the same seed.
"""

from __future__ import annotations

import pytest
import torch
from _stream_train import assert_same_run, batches, make_model, train

from tiermem.optim.hybrid_adam import HybridAdam
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights
from tiermem.stream.checksums import checksum, piece_checksum

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster
STEPS = 8
CHANGED = r"blocks\[{}\]\.{} was changed in place on the device during a pass"


@pytest.fixture
def stores(make_stream_store):
    """``stores()``: a CPU store, 16 MiB RAM, a 64 MiB NVMe tier."""
    return lambda: make_stream_store(nvme_bytes=64 << 20)


# ---------------------------------------------------------------- between passes


def _eval_then_scale(model, step):
    """An evaluation under no_grad (a pass that ends with no optimizer step after it), then a
    ``.data`` write to two streamed weights: their ``_version`` does not move."""
    with torch.no_grad():
        model(*batches(100 + step, 1)[0])
        model.blocks[1].fc.weight.data.mul_(0.9)
        model.blocks[2].ln1.weight.data.add_(0.01 * (step + 1))


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("n_micro", [1, 2])
def test_a_data_write_between_passes_is_streamed(stores, tier, n_micro):
    """Before, with ``tier="nvme"`` the store's copy was rewritten only when ``_version`` moved
    or an optimizer had stepped since the last pass start; the evaluation pass had taken that
    step, so every later fill read the NVMe copy from before the ``.data`` write: the losses
    differed from the first step on."""
    want = train(make_model(), n_micro=n_micro, between_steps=_eval_then_scale)
    got = train(make_model(), n_micro=n_micro, between_steps=_eval_then_scale,
                stream=lambda m: stream_weights(m.blocks, store=stores(), tier=tier))
    try:
        assert_same_run(got[:2], want[:2], f"{tier} .data write between passes")
        if tier == "nvme":  # the written weights once per step and the write's own passes
            assert got[2].stats()["nvme_writes"] > 0
    finally:
        got[2].close()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_data_write_between_steps_with_hybrid_adam_is_as_unstreamed(stores, tier):
    """HybridAdam connected (it writes the host copies from its masters and marks them
    changed): a ``.data`` write after an evaluation pass is streamed to the next forward and
    taken into HybridAdam's masters, as the unstreamed HybridAdam does (Note [param
    checksums]). Before, the streamed master was stepped from before the write and written
    back over it (the write lasted one step; a strict xfail until then); earlier still, with
    ``tier="nvme"`` the next forward streamed the NVMe copy from before the write."""
    from test_stream_combined import _train as hybrid_train

    def between(run, step):
        _eval_then_scale(run.model, step)

    want = hybrid_train(stores, False, between=between, tier=tier, state_tier="cpu")
    got = hybrid_train(stores, True, between=between, tier=tier, state_tier="cpu")
    assert_same_run(got, want, f"{tier} .data write with HybridAdam")


def _scale_after_step(model, step):
    """``.data`` writes to streamed weights right after ``step()`` (no pass between): a scale,
    a shift and a copy of other values into some rows; the weights change every step."""
    with torch.no_grad():
        model.blocks[0].qkv.weight.data.mul_(0.95)
        model.blocks[2].ln1.weight.data.add_(0.01 * (step + 1))
        model.blocks[3].fc.weight.data[:2].copy_(torch.full((2, 32), 0.001 * step))


def _hybrid(stores, streamed, *, tier="cpu", fraction=1.0, n_micro=2, clip=None, overlap=True,
            sync="step", major=False, write=_scale_after_step, fb=None,
            dtype=torch.float32):
    """8 HybridAdam steps of ``n_micro`` micro-batches (``fb(model, batches)``, else
    depth-first or block-major), ``write(model, step)`` before each step's first forward.
    Returns ``((losses, final weights), the watch's sum counts)``."""
    model = make_model(dtype)
    stream = stream_weights(model.blocks, store=stores(), tier=tier, prefetch_blocks=1) \
        if streamed else None
    opt = HybridAdam(model.parameters(), lr=3e-3, weight_decay=0.1, offload_fraction=fraction,
                     chunk_numel=2048, max_grad_norm=clip, grad_accumulation_steps=n_micro,
                     overlap=overlap, param_sync=sync)
    losses = []
    try:
        for step in range(STEPS):
            write(model, step)
            mb = batches(step, n_micro)
            out = fb(model, mb) if fb else forward_backward(model, mb, block_major=major)
            losses.append(torch.stack(out).detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
        opt.synchronize()
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return (losses, weights), dict(opt._watch._sums.stats)
    finally:
        opt.close()
        if stream is not None:
            stream.close()


HYBRID = [  # _hybrid's keywords
    pytest.param({}, id="f1-acc2-overlap"),
    pytest.param({"fraction": 0.5}, id="f0.5-acc2-overlap"),
    # bf16 weights: fp32 masters apart from them in the chunks and on the GPU side (an fp32
    # weight's GPU-side share is its own master: the host copy itself)
    pytest.param({"fraction": 0.5, "dtype": torch.bfloat16}, id="bf16-f0.5-acc2-overlap"),
    pytest.param({"clip": 0.5}, id="f1-acc2-clip"),
    pytest.param({"fraction": 0.5, "n_micro": 1, "overlap": False}, id="f0.5-no-overlap"),
    pytest.param({"major": True, "fraction": 0.5}, id="f0.5-acc2-block-major"),
    # param_sync="forward": a write after the next forward began the step's completion (an
    # evaluation first; before it, Note [param changes] asks for synchronize())
    pytest.param({"sync": "forward", "write": _eval_then_scale}, id="f1-acc2-sync-forward"),
    # and one between the micro-batches of each step (the second pass streams it)
    pytest.param({"fb": lambda m, mb: _between_micro_batches(m, mb)},
                 id="f1-acc2-between-micro-batches"),
]


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("kw", HYBRID)
def test_streamed_masters_take_a_data_write_as_unstreamed(stores, tier, kw):
    """Note [streamed write-back checksums]: a ``.data`` write to streamed weights after every
    ``step()`` is taken into HybridAdam's masters (chunks and, below fraction 1, the GPU
    side) exactly as unstreamed, bit for bit at every step and in the final weights. Before,
    the streamed masters were stepped from before each write and written back over it."""
    want, _ = _hybrid(stores, False, **kw)
    got, _ = _hybrid(stores, True, tier=tier, **kw)
    assert_same_run(got, want, f"{tier} {kw}")
    assert not torch.equal(want[1]["blocks.0.qkv.weight"],
                           make_model().state_dict()["blocks.0.qkv.weight"])  # trained


@pytest.mark.parametrize("kw", [
    pytest.param({}, id="f1-acc2-overlap"),
    pytest.param({"fraction": 0.5, "dtype": torch.bfloat16}, id="bf16-f0.5-acc2-overlap"),
    pytest.param({"fraction": 0.5, "n_micro": 1, "overlap": False}, id="f0.5-no-overlap"),
    pytest.param({"write": lambda m, s: None, "fb": lambda m, mb: _between_micro_batches(m, mb)},
                 id="f1-acc2-only-between-micro-batches"),
])
def test_without_the_refresh_of_streamed_masters_the_runs_differ(stores, monkeypatch, kw):
    """The must-fail twin of the test above: with the refresh of streamed weights' masters
    switched off (what the code did before), the same comparison fails (so it can)."""
    from tiermem.optim.param_watch import ParamWatch
    refresh = ParamWatch._refresh

    def no_streamed_refresh(self, gi, i, rebind):
        if i not in self._layout.groups[gi].host_copies:
            refresh(self, gi, i, rebind)

    want, _ = _hybrid(stores, False, **kw)
    monkeypatch.setattr(ParamWatch, "_refresh", no_streamed_refresh)
    got, _ = _hybrid(stores, True, **kw)
    with pytest.raises(AssertionError, match="no refresh"):
        assert_same_run(got, want, "no refresh")


def test_the_streamed_sums_are_not_read_again(stores, monkeypatch):
    """Note [streamed write-back checksums]: the sum of a host copy after the write-back is
    added up by the chunk worker from the pieces it wrote (no read of the host copy), and with
    overlap the comparison runs at the first gradient hand-over, inside the step's last
    backward pass, taking each streamed weight's sum now from its block's first fill in that
    pass: only resident parameters are summed again. Without overlap the comparison runs in
    ``step()``, after the pass: every host copy is read then. The sums never disagree but
    for a write: no refresh without one, one per written weight and step with them."""
    from tiermem.optim.param_watch import ParamWatch
    refreshed = []
    refresh = ParamWatch._refresh
    monkeypatch.setattr(ParamWatch, "_refresh", lambda self, gi, i, rebind: (
        refreshed.append(i), refresh(self, gi, i, rebind=rebind)))
    model = make_model()
    n_resident = sum(1 for n, _ in model.named_parameters() if not n.startswith("blocks."))
    n_streamed = sum(1 for n, _ in model.named_parameters() if n.startswith("blocks."))
    _, overlap = _hybrid(stores, True)
    assert len(refreshed) == 3 * (STEPS - 1)  # _scale_after_step's 3 weights from step 1 on
    # one comparison per step; step 0's in step() (its backward only records the order the
    # gradients arrive in: Note [trace placement]), the others at a hand-over in the backward
    assert overlap == {"known_sums": (STEPS - 1) * n_streamed,
                       "read_sums": STEPS * n_resident + n_streamed,
                       "known_bases": STEPS * n_streamed,
                       "read_bases": n_resident + n_streamed + STEPS * n_resident}
    refreshed.clear()
    _, late = _hybrid(stores, True, overlap=False, n_micro=1, write=lambda m, s: None)
    assert refreshed == []
    assert late["known_sums"] == 0
    assert late["read_sums"] == STEPS * (n_resident + n_streamed)
    assert late["known_bases"] == STEPS * n_streamed


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.cuda), "cpu"])
@pytest.mark.parametrize("dtype,fraction,refresh", [
    pytest.param(torch.float32, 1.0, True, id="fp32-f1"),
    pytest.param(torch.bfloat16, 1.0, True, id="bf16-f1"),
    pytest.param(torch.float32, 0.5, True, id="fp32-f0.5"),
    pytest.param(torch.bfloat16, 0.5, True, id="bf16-f0.5"),
    # the twins (an fp32 weight's GPU-side share is its own master: no twin for fp32-f0.5)
    pytest.param(torch.float32, 1.0, False, id="fp32-f1-twin-no-refresh"),
    pytest.param(torch.bfloat16, 0.5, False, id="bf16-f0.5-twin-no-refresh"),
])
def test_a_data_write_reaches_the_streamed_masters_on_the_device(device, dtype, fraction,
                                                                  refresh, monkeypatch):
    """Note [streamed write-back checksums] where the stream computes on a device (on CUDA the
    fill sums are taken on the copy stream and reach the host through pinned memory behind an
    event; the worker's piece sums are taken on the host: the two must agree to the bit).
    8 steps of 2 micro-batches, blocks[1].fc.weight zeroed through ``.data`` after step 3:
    exactly one refresh (no false alarm in any other step), and the next step trains it from
    zero (every entry within a few ``lr`` of 0; its entries were up to 0.18 before). The twin
    with the refresh off must see the old values come back (so the check can fail)."""
    from tiermem import StoreConfig, TierStore
    from tiermem.optim.param_watch import ParamWatch
    refreshed = []
    real = ParamWatch._refresh
    monkeypatch.setattr(ParamWatch, "_refresh", lambda self, gi, i, rebind: (
        refreshed.append(i), refresh and real(self, gi, i, rebind=rebind)))
    lr = 1e-3
    model = make_model(dtype).to(device)
    store = TierStore(StoreConfig(device=device, gpu_bytes=1 << 20, cpu_bytes=16 << 20,
                                  pool_slab_bytes=1 << 20, nvme_bytes=0))
    stream = stream_weights(model.blocks, store=store, prefetch_blocks=1)
    opt = HybridAdam(model.parameters(), lr=lr, weight_decay=0.0, offload_fraction=fraction,
                     chunk_numel=2048, grad_accumulation_steps=2)
    w = model.blocks[1].fc.weight
    try:
        for step in range(STEPS):
            for k, (idx, tgt) in enumerate(batches(step, 2)):
                _, loss = model(idx.to(device), tgt.to(device))
                if device == "cuda":  # the fills' sums have landed by the first hand-over
                    torch.cuda.synchronize()  # (else the host copy is read: the same sums)
                (loss / 2).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step == 3:
                assert w.data.abs().max() > 0.05
                w.data.zero_()  # between passes: the host copy
            if step == 4:
                assert (w.data.abs().max() <= 10 * lr) == refresh
        assert len(refreshed) == 1
        stats = opt._watch._sums.stats
        n_streamed = sum(1 for n, _ in model.named_parameters() if n.startswith("blocks."))
        assert stats["known_sums"] == (STEPS - 1) * n_streamed
        if fraction == 1.0:
            assert stats["known_bases"] == STEPS * n_streamed
    finally:
        opt.close()
        stream.close()
        store.close()


def _between_micro_batches(model, mbs):
    """Depth-first micro-batches with a ``.data`` write between them (no step between)."""
    out = []
    for k, (idx, tgt) in enumerate(mbs):
        if k:
            with torch.no_grad():
                model.blocks[0].qkv.weight.data.mul_(0.99)
        _, loss = model(idx, tgt)
        (loss / len(mbs)).backward()
        out.append(loss.detach())
    return out


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_what_param_data_is_between_passes_and_in_an_open_one(stores, tier):
    """Note [streamed weight checksums], what a ``.data`` write lands in: between passes (after
    a backward, after a ``no_grad`` forward) ``param.data`` IS the host copy, at every tier;
    after a forward that recorded a graph, also once its outputs are dropped, the pass is still
    open and a released block's ``.data`` is an empty placeholder, until the next forward ends
    that pass (then it is the host copy again, unchanged)."""
    model = make_model()
    h = stream_weights(model.blocks, store=stores(), tier=tier, prefetch_blocks=0)
    w = model.blocks[0].fc.weight
    host = h.host_copy(w)
    try:
        (idx, tgt), = batches(0, 1)
        model(idx, tgt)[1].backward()
        assert not h.in_pass and w.data.data_ptr() == host.data_ptr()
        with torch.no_grad():
            model(idx, tgt)
        assert not h.in_pass and w.data.data_ptr() == host.data_ptr()
        w.data.mul_(0.5)  # between passes: the host copy itself
        assert torch.equal(host, model.blocks[0].fc.weight.detach())
        before = host.clone()
        model(idx, tgt)  # a graph recorded, its outputs dropped at once
        assert h.in_pass and w.data.numel() == 0 and w.data.device == h.device
        with torch.no_grad():
            model(idx, tgt)  # ends the open pass first
        assert not h.in_pass and w.data.data_ptr() == host.data_ptr()
        assert torch.equal(host, before)
    finally:
        h.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_data_write_between_micro_batches_is_streamed(stores, tier):
    """Before, with ``tier="nvme"`` the second micro-batch's fills read the NVMe copy written at
    the first pass start (no optimizer step in between): the losses differed from step 0."""
    want = train(make_model(), n_micro=2, fb=_between_micro_batches)
    got = train(make_model(), n_micro=2, fb=_between_micro_batches,
                stream=lambda m: stream_weights(m.blocks, store=stores(), tier=tier))
    try:
        assert_same_run(got[:2], want[:2], f"{tier} .data write between micro-batches")
    finally:
        got[2].close()


# ---------------------------------------------------------------- during a pass


def _run(stores, streamed, *, edit=None, fail_step=None, skip=(), major=False, tier="cpu",
         prefetch=1, match=None, skipped=None):
    """8 AdamW steps; at ``fail_step`` ``edit(model, batches)`` must raise ``match`` (then the
    gradients are zeroed and the step skipped); steps in ``skip`` are not run at all (the
    reference of a refused step), but for ``skipped(model)`` if given."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    h = stream_weights(model.blocks, store=stores(), tier=tier, prefetch_blocks=prefetch) \
        if streamed else None
    n_micro = 2 if major else 1
    losses = []
    try:
        for step in range(STEPS):
            mb = batches(step, n_micro)
            if step in skip:
                if skipped is not None:
                    skipped(model)
                continue
            if step == fail_step:
                with pytest.raises(RuntimeError, match=match) as err:
                    edit(model, mb)
                assert "\n" not in str(err.value)
                assert not h.in_pass and not h.closed  # the pass ended, the stream usable
                opt.zero_grad(set_to_none=True)
                continue
            losses.append(torch.stack(forward_backward(model, mb, block_major=major)))
            opt.step()
            opt.zero_grad(set_to_none=True)
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return losses, weights, h
    finally:
        if h is not None:
            h.close()


def _scale_kept_block_before_backward(model, mb):
    idx, tgt = mb[0]
    _, loss = model(idx, tgt)
    model.blocks[3].fc.weight.data.mul_(0.5)  # blocks[3] is kept on the device for backward
    loss.backward()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_data_write_between_forward_and_backward_is_refused(stores, tier):
    """``.data.mul_`` of a weight whose block the forward kept on the device for the backward:
    the backward read the scaled weight, the forward had used the old one, and the pass end put
    the host copy back, so the step stepped the old weight with a gradient of the new one.
    Now refused when the backward releases the block; the host copy keeps its value from
    before the pass (the change is discarded), and training goes on exactly as if the step had
    not been run. Before: no error, and from step 4 on the losses differed from the same loop
    unstreamed (the same edit, no error)."""
    want = _run(stores, False, skip={3}, tier=tier)
    got = _run(stores, True, edit=_scale_kept_block_before_backward, fail_step=3, tier=tier,
               match=CHANGED.format(3, "fc.weight") + r".*param\.mul_")
    assert_same_run(got, want, "refused step")


def _scale_in_forward(model, mb, major=False):
    fired = []

    def scale(m, args):
        if not fired:
            fired.append(1)
            m.weight.data.mul_(0.5)  # block 0 is on the device: its buffer changes

    handle = model.blocks[0].fc.register_forward_pre_hook(scale)
    try:
        forward_backward(model, mb, block_major=major)
    finally:
        handle.remove()


@pytest.mark.parametrize("major", [False, True], ids=["depth-first", "block-major"])
def test_a_data_write_inside_a_blocks_forward_is_refused(stores, major):
    """A ``.data`` write to a block's weight while the block computes (a hook inside it): the
    rest of the forward read the new weight, the backward the refilled old one. Refused when
    the forward releases the block (prefetch 0: blocks[0] is not kept for the backward).
    Before: no error, and from step 4 on the losses differed from the same loop unstreamed."""
    want = _run(stores, False, skip={3}, major=major, prefetch=0)
    got = _run(stores, True, edit=lambda m, mb: _scale_in_forward(m, mb, major), fail_step=3,
               major=major, prefetch=0, match=CHANGED.format(0, "fc.weight"))
    assert_same_run(got, want, "refused step")


def _scale_host_copy(model):
    with torch.no_grad():
        model.blocks[0].fc.weight.data.mul_(0.5)


def _scale_a_kept_reference(model, mb):
    host = model.blocks[0].fc.weight.data  # between passes: the host copy itself
    idx, tgt = mb[0]
    _, loss = model(idx, tgt)
    host.mul_(0.5)  # during the pass: blocks[0] was released, its backward refills it
    loss.backward()


def test_a_host_copy_written_during_a_pass_is_refused(stores):
    """A reference to ``param.data`` taken between passes is the host copy: writing it during
    the pass made the backward refill blocks[0] with other weights than its forward used (a
    gradient of neither; unstreamed computes the same mix, but a kept block's backward would
    not see the write at all: a weight changed during a pass is refused, Note [streamed
    weight checksums]). Now the refill's checksums differ from the first fill's and the
    backward is refused; the host copy keeps the write, and training goes on exactly as the
    same write with the step skipped. Before: no error."""
    want = _run(stores, False, skip={3}, skipped=_scale_host_copy)
    got = _run(stores, True, edit=_scale_a_kept_reference, fail_step=3,
               match=r"blocks\[0\]\.fc\.weight was filled with other values than earlier in the "
                     r"same pass.*host copy keeps the new values")
    assert_same_run(got, want, "refused refill")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("numel", [1, 3, 7, 64, 257])
def test_the_checksum_sees_every_single_element_change(dtype, numel):
    """Note [streamed weight checksums]: integer sums of the bytes, so any one element changed
    (in the 8-byte words or the byte-summed tail) moves the sum, even by one unit in the last
    place, which an fp32 sum of a large tensor rounds away."""
    t = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    base = checksum(t)
    for k in range(numel):
        u = t.clone()
        u[k] = u[k] * 2 + 1
        assert not torch.equal(u, t)
        assert checksum(u) != base, f"{dtype} numel {numel}: element {k} changed unseen"
    big = torch.ones(1 << 20)
    nudged = big.clone()
    nudged[0] = torch.nextafter(nudged[0], torch.tensor(2.0))
    assert big.sum() == nudged.sum()  # a float sum misses it
    assert checksum(big) != checksum(nudged)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.uint8])
@pytest.mark.parametrize("numel", [1, 3, 7, 8, 9, 17, 257])
def test_the_checksums_of_pieces_add_up_to_the_whole(dtype, numel):
    """Note [streamed write-back checksums]: the worker sums the pieces it wrote; whatever the
    cuts (inside a word, in the byte-summed tail), they add up to the whole's checksum, and a
    piece's own change moves its sum."""
    gen = torch.Generator().manual_seed(numel)
    t = (torch.randn(numel, generator=gen) * 100).to(dtype)
    whole = int(checksum(t)) & ((1 << 64) - 1)
    for trial in range(12):
        cuts = sorted(set(torch.randint(1, numel, (trial % 5,), generator=gen).tolist())) \
            if numel > 1 else []
        bounds = [0, *cuts, numel]
        parts = [piece_checksum(t, a, b - a) for a, b in zip(bounds, bounds[1:])]
        assert sum(parts) & ((1 << 64) - 1) == whole, f"{dtype} {numel} cut at {cuts}"
    u = t.clone()
    u[numel // 2] = u[numel // 2] + 1
    assert piece_checksum(u, numel // 2, 1) != piece_checksum(t, numel // 2, 1)


def test_what_the_checksum_cannot_see():
    """The documented blind spot (Note [streamed weight checksums]): a permutation of whole
    8-byte words (here two swapped rows of fp32 pairs) keeps the sum."""
    t = torch.randn(4, 2)
    swapped = t[[1, 0, 2, 3]].contiguous()
    assert not torch.equal(t, swapped) and checksum(t) == checksum(swapped)


def test_a_data_write_that_changes_nothing_is_not_refused(stores):
    """Only a change is refused: ``.data.copy_`` of the same values (a reload of the weights
    the block holds) during a pass passes, and training is bit-identical."""
    def same_values(model, mb):
        idx, tgt = mb[0]
        _, loss = model(idx, tgt)
        w = model.blocks[3].fc.weight
        w.data.copy_(w.data.clone())
        loss.backward()
        return [loss.detach()]

    want = train(make_model())
    got = train(make_model(), fb=same_values,
                stream=lambda m: stream_weights(m.blocks, store=stores()))
    try:
        assert_same_run(got[:2], want[:2], "same values")
    finally:
        got[2].close()
