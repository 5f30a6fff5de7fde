"""Note [block-major passes]: the block-major schedule with weight streaming gives the bits of
the depth-first loop without streaming, fetches each streamed block once per pass whatever the
number of micro-batches, and the stream refuses every other call sequence inside the pass."""

from __future__ import annotations

import pytest
import torch
from _stream_train import batches, make_model, train

from tiermem.schedule import block_major as bm
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster


@pytest.fixture
def store(make_stream_store):
    return make_stream_store(cpu_bytes=8 << 20, nvme_bytes=16 << 20)


def _equal(a, b):
    assert len(a[0]) == len(b[0])
    for step, (x, y) in enumerate(zip(a[0], b[0])):
        assert torch.equal(x, y), f"step {step}: losses {x.tolist()} != {y.tolist()}"
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), f"final weight {k} differs"


def _block_major(saved_store=None, saved_tier="cpu"):
    return lambda m, b: forward_backward(m, b, block_major=True, saved_store=saved_store,
                                         saved_tier=saved_tier)


CASES = [  # kind, tier, prefetch, dtype, micro-batches, saved inputs, resident, checkpoint, clip
    ("gpt", "cpu", 1, torch.float32, 4, None, None, False, None),
    ("gpt", "nvme", 0, torch.bfloat16, 2, "cpu", (3,), True, 1.0),
    ("moe", "cpu", 2, torch.bfloat16, 2, "nvme", None, False, 0.5),
    ("moe", "nvme", 1, torch.float32, 1, None, (0,), False, None),
]


@pytest.mark.parametrize("kind,tier,prefetch,dtype,n_micro,saved,resident,ckpt,clip", CASES)
def test_block_major_streaming_is_bit_identical_with_one_fill_per_pass(
        store, kind, tier, prefetch, dtype, n_micro, saved, resident, ckpt, clip):
    """8 AdamW steps, different batches: losses every step and the final weights equal the
    depth-first loop's without streaming, and each step fills each streamed block exactly twice
    (forward, backward), whatever the number of micro-batches, but the last ones, kept on the
    device from the forward into the backward (once)."""
    steps = 8
    ref = train(make_model(dtype, ckpt, kind=kind), steps=steps, n_micro=n_micro, clip=clip)
    handles, fills = [], []

    def stream(m):
        handles.append(stream_weights(m.blocks, store=store, tier=tier,
                                      prefetch_blocks=prefetch, resident=resident))
        return handles[0]

    def count(model, step):
        fills.append(handles[0].stats()["fills"])

    n_keys = None
    out = train(make_model(dtype, ckpt, kind=kind), steps=steps, n_micro=n_micro, clip=clip,
                stream=stream, before_step=count,
                fb=_block_major(store if saved else None, saved or "cpu"))
    _equal(out, ref)
    h = handles[0]
    streamed = len(h.plan.streamed)
    assert streamed == 4 - (len(resident) if resident else 0)
    per_step = [b - a for a, b in zip([0] + fills, fills)]
    kept = h.plan.streamed[-(prefetch + 2):]  # Note [kept into backward]
    assert h.plan.kept == kept
    assert per_step == [2 * streamed - len(kept)] * steps
    assert h.stats()["peak_blocks"] <= h.plan.buffer_blocks
    n_keys = sum(len(list(make_model(kind=kind).blocks[i].parameters()))
                 for i in h.plan.streamed)
    assert len(store) == n_keys  # every saved input was deleted after its backward
    if saved:
        moved = store.stats()["moved_bytes"]
        assert moved.get("cpu->gpu", 0) + moved.get("nvme->gpu", 0) > 0  # read back
    h.close()


def test_depth_first_streaming_fills_grow_with_micro_batches(store):
    """The cost the block-major schedule removes: depth-first fills each block 2 * M times
    (but the 3 kept into each backward: M times)."""
    model = make_model()
    h = stream_weights(model.blocks, store=store)
    forward_backward(model, batches(0, 3))
    assert h.stats()["fills"] == (2 * 4 - 3) * 3
    forward_backward(model, batches(1, 3), block_major=True)
    assert h.stats()["fills"] == (2 * 4 - 3) * 3 + 2 * 4 - 3
    h.close()


def test_accumulation_over_two_block_major_passes_is_exact(store):
    """Two passes before each optimizer step: the second pass adds each micro-batch's gradient
    to the host gradient in order (Note [block-major passes]), as the loop without streaming."""
    def twice(fb):
        def run(model, mb):
            return fb(model, mb[:2]) + fb(model, mb[2:])
        return run

    ref = train(make_model(), steps=8, n_micro=4, fb=twice(forward_backward))
    out = train(make_model(), steps=8, n_micro=4, fb=twice(_block_major()),
                stream=lambda m: stream_weights(m.blocks, store=store, prefetch_blocks=1))
    _equal(out, ref)
    out[2].close()


def test_the_comparison_fails_with_a_stale_saved_input(store, monkeypatch):
    """Must go red: block 2 recomputes micro-batch 1 from micro-batch 0's input."""
    ref = train(make_model(), steps=8, n_micro=2)
    stale: dict = {}
    get = bm.SavedInputs.get

    def stale_get(self, i, m):
        x = get(self, i, m)
        if i == 2 and m == 0:
            stale["x"] = x.clone()
        return stale["x"] if (i, m) == (2, 1) else x

    monkeypatch.setattr(bm.SavedInputs, "get", stale_get)
    out = train(make_model(), steps=8, n_micro=2, fb=_block_major(store),
                stream=lambda m: stream_weights(m.blocks, store=store))
    assert torch.equal(out[0][0], ref[0][0])  # the forward of step 0 is unchanged
    with pytest.raises(AssertionError):
        _equal(out, ref)
    out[2].close()


# ---------------------------------------------------------------------- the pass's sequence


def _inputs(model, n):
    with torch.no_grad():
        return [model.embed(idx) for idx, _ in batches(0, n)]


def test_calls_out_of_the_sequence_are_refused_and_the_pass_goes_on(store):
    model = make_model()
    h = stream_weights(model.blocks, store=store)
    xs = _inputs(model, 2)
    with pytest.raises(RuntimeError, match=r"left before its sequence ended \(backward phase, "
                                           r"blocks\[1\] micro-batch 1 next\)"):
        with h.block_major(2):
            with pytest.raises(RuntimeError, match=r"blocks\[1\] called out of order in the "
                                                   r"forward phase.*blocks\[0\] runs next"):
                with torch.no_grad():
                    model.blocks[1](xs[0])
            with pytest.raises(RuntimeError, match="autograd on in the forward phase"):
                model.blocks[0](xs[0])
            with torch.no_grad():
                for i in range(4):
                    xs = [model.blocks[i](x) for x in xs]
                with pytest.raises(RuntimeError, match=r"no_grad\(\) in the backward phase"):
                    model.blocks[3](xs[0])
            with pytest.raises(RuntimeError, match=r"blocks\[0\] called out of order in the "
                                                   r"backward phase.*blocks\[3\] runs next"):
                model.blocks[0](xs[0])
            ys = [model.blocks[3](x.requires_grad_()) for x in xs]
            with pytest.raises(RuntimeError, match=r"blocks\[3\] called out of order"):
                model.blocks[3](xs[0])  # a third micro-batch
            ys[0].sum().backward()
            y2 = model.blocks[2](xs[0])  # the pass moves on: blocks[3] is released
            with pytest.raises(RuntimeError, match=r"backward reached blocks\[3\].*after the "
                                                   r"pass moved on"):
                ys[1].sum().backward()
            y2.sum().backward()
            model.blocks[2](xs[1]).sum().backward()
            model.blocks[1](xs[0]).sum().backward()
    assert not h.in_pass
    forward_backward(model, batches(1, 2), block_major=True)  # the next pass is whole
    h.close()


def test_leaving_a_pass_early_raises_and_the_stream_stays_usable(store):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    h = stream_weights(model.blocks, store=store)
    xs = _inputs(model, 2)
    with pytest.raises(RuntimeError, match=r"left before its sequence ended \(forward phase, "
                                           r"blocks\[1\] micro-batch 0 next\)"):
        with h.block_major(2):
            with torch.no_grad():
                xs = [model.blocks[0](x) for x in xs]
            with pytest.raises(RuntimeError, match=r"AdamW.step\(\) during a weight-streaming"):
                opt.step()
            with pytest.raises(RuntimeError, match="a forward/backward pass is open"):
                with h.block_major(2):
                    pass
    assert not h.in_pass and model.blocks[0].fc.weight.device.type == "cpu"
    opt.zero_grad(set_to_none=True)
    forward_backward(model, batches(1, 2))  # depth-first after it
    forward_backward(model, batches(2, 2), block_major=True)
    opt.step()
    h.close()
    assert len(store) == 0


def test_a_failed_fill_ends_the_pass_and_leaves_nothing_saved(store):
    model = make_model()
    h = stream_weights(model.blocks, store=store)
    calls = []

    def fault(block, p, src):
        calls.append(block.index)
        if len(calls) > 12 * 4:  # the 5th fill, the backward phase's only one (blocks[0]: 1-3
            raise OSError("injected read failure")  # are kept, Note [kept into backward])
        return src

    h._fetcher.fault = fault
    with pytest.raises(OSError, match="injected"):
        forward_backward(model, batches(0, 2), block_major=True, saved_store=store)
    assert not h.in_pass and len(store) == 4 * 12  # only the stream's weights are stored
    h._fetcher.fault = None
    forward_backward(model, batches(0, 2), block_major=True, saved_store=store)
    h.close()


def test_bad_arguments_are_named(store):
    model = make_model()
    h = stream_weights(model.blocks, store=store)
    with pytest.raises(ValueError, match="n_micro=0"):
        h.block_major(0)
    with pytest.raises(ValueError, match="block_major=True runs every block breadth-first"):
        forward_backward(model, batches(0, 2), block_major=True, breadth_first_blocks=1)
    with pytest.raises(ValueError, match="saved_store keeps the block-major"):
        forward_backward(model, batches(0, 2), saved_store=store)
    with pytest.raises(ValueError, match="saved_tier='disk' is unknown"):
        forward_backward(model, batches(0, 2), block_major=True, saved_store=store,
                         saved_tier="disk")
    with pytest.raises(TypeError, match="saved_store must be a tiermem.TierStore"):
        forward_backward(model, batches(0, 2), block_major=True, saved_store="cpu")
    h.close()
    first = stream_weights(model.blocks[:2], store=store)
    second = stream_weights(model.blocks[2:], store=store)
    with pytest.raises(ValueError, match="streamed by 2 WeightStreams"):
        forward_backward(model, batches(0, 2), block_major=True)
    second.close()
    forward_backward(model, batches(0, 2), block_major=True)  # a stream of the first blocks
    assert first.stats()["fills"] == 2  # both kept into the backward
    first.close()
    assert len(store) == 0
