"""Weight streaming is exact: training a small GPT with its blocks' weights streamed through a
TierStore gives the same bits as the same loop without streaming (Note [weight streaming])."""

from __future__ import annotations

import pytest
import torch

from tiermem import StoreConfig, TierStore
from tiermem.stream import stream_weights

from _stream_train import batches, make_model, train
from tiermem.schedule.micro_batches import forward_backward


@pytest.fixture
def store(tmp_path):
    stores = []

    def make(**kw):
        kw.setdefault("gpu_bytes", 1 << 20)
        kw.setdefault("cpu_bytes", 8 << 20)
        if kw.get("nvme_bytes"):
            kw.setdefault("nvme_dir", str(tmp_path))
            kw.setdefault("io_backend", "posix")
            kw.setdefault("io_threads", 2)
        kw.setdefault("pool_slab_bytes", 1 << 20)
        s = TierStore(StoreConfig(device="cpu", **kw))
        stores.append(s)
        return s

    yield make
    for s in stores:
        s.close()


def _equal(a, b):
    assert len(a[0]) == len(b[0])
    for step, (x, y) in enumerate(zip(a[0], b[0])):
        assert torch.equal(x, y), f"step {step}: losses {x.tolist()} != {y.tolist()}"
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), f"final weight {k} differs"


CASES = [  # tier, prefetch, dtype, micro-batches, checkpoint, clip, resident, gpu_bytes
    ("cpu", 1, torch.float32, 1, False, None, None, None),
    ("cpu", 0, torch.bfloat16, 3, True, 1.0, None, None),
    ("cpu", 2, torch.float32, 2, True, 0.5, (3,), None),
    ("cpu", 1, torch.bfloat16, 1, True, 1.0, (2, 3), None),
    ("nvme", 1, torch.bfloat16, 2, False, 1.0, None, None),
    ("nvme", 2, torch.float32, 3, False, None, (3,), None),
    ("nvme", 0, torch.float32, 4, True, 0.5, None, "gpu_bytes"),
]


@pytest.mark.parametrize("tier,prefetch,dtype,n_micro,ckpt,clip,resident,budget", CASES)
def test_streamed_training_is_bit_identical(store, one_thread, tier, prefetch, dtype, n_micro,
                                            ckpt, clip, resident, budget):
    steps = 8
    ref = train(make_model(dtype, ckpt), steps=steps, n_micro=n_micro, clip=clip)
    block_bytes = sum(p.numel() * p.element_size() for p in make_model(dtype).blocks[0]
                      .parameters())
    gpu_bytes = None
    if budget:  # the last block resident plus prefetch + 2 buffers (2 resident + 2 > budget)
        gpu_bytes = block_bytes * (1 + prefetch + 2)
    nvme = {"nvme_bytes": 16 << 20, "cpu_bytes": 3 * block_bytes + (1 << 16)} \
        if tier == "nvme" else {}
    s = store(**nvme)
    out = train(make_model(dtype, ckpt), steps=steps, n_micro=n_micro, clip=clip,
                stream=lambda m: stream_weights(m.blocks, store=s, tier=tier,
                                                prefetch_blocks=prefetch, resident=resident,
                                                gpu_bytes=gpu_bytes))
    handle = out[2]
    _equal(out, ref)
    streamed = handle.plan.streamed
    if budget:
        assert handle.plan.resident == (3,)
    # each streamed block is copied in once per forward and once per backward, no more, but
    # the last prefetch + 2 stay from the forward into the backward (Note [kept into backward])
    kept = streamed[-(prefetch + 2):]
    assert handle.plan.kept == kept
    stats = handle.stats()
    assert stats["fills"] == (2 * len(streamed) - len(kept)) * n_micro * steps
    assert stats["peak_blocks"] <= handle.plan.buffer_blocks
    if tier == "nvme":  # written after each optimizer step only (not per micro-batch)
        n_params = sum(len(list(make_model().blocks[i].parameters())) for i in streamed)
        assert stats["nvme_writes"] == (steps - 1) * n_params
        assert s.stats()["moved_bytes"].get("nvme->cpu", 0) > 0  # weights came off the disk
    handle.close()


def test_one_step_stale_weight_is_caught(store, one_thread):
    """The comparison must go red when one block's device buffer holds last step's weights."""
    ref = train(make_model(), steps=8)
    snapshot: dict = {}

    def stale(block, p, src):  # block 1 gets the weights of the step before
        return snapshot.get(p.name, src) if block.index == 1 else src

    def before_step(model, step):
        for name, q in model.blocks[1].named_parameters():
            snapshot[name] = q.detach().clone()  # this step's weights, stale after the step

    s = store()

    def stream(m):
        h = stream_weights(m.blocks, store=s, prefetch_blocks=1)
        h._fetcher.fault = stale
        return h

    out = train(make_model(), steps=8, stream=stream, before_step=before_step)
    assert torch.equal(out[0][0], ref[0][0])  # step 0: nothing stale yet
    assert not all(torch.equal(x, y) for x, y in zip(out[0], ref[0]))
    with pytest.raises(AssertionError):
        _equal(out, ref)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_weight_changed_between_steps_is_taken(store, one_thread, tier):
    def change(model, step):
        if step in (3, 5):
            with torch.no_grad():
                model.blocks[1].fc.weight.mul_(0.5)
                model.blocks[2].out.bias.add_(0.25)

    ref = train(make_model(), steps=8, n_micro=2, between_steps=change)
    s = store(**({"nvme_bytes": 8 << 20} if tier == "nvme" else {}))
    out = train(make_model(), steps=8, n_micro=2, between_steps=change,
                stream=lambda m: stream_weights(m.blocks, store=s, tier=tier))
    _equal(out, ref)


def test_replaced_data_between_passes_is_taken(store, one_thread):
    def replace(model, step):
        if step == 2:
            w = model.blocks[0].qkv.weight
            w.data = torch.full_like(w.data, 0.01)

    ref = train(make_model(), steps=8, between_steps=replace)
    s = store(nvme_bytes=8 << 20)
    out = train(make_model(), steps=8, between_steps=replace,
                stream=lambda m: stream_weights(m.blocks, store=s, tier="nvme"))
    _equal(out, ref)


def test_close_returns_ordinary_parameters_and_training_goes_on(store, one_thread):
    ref = train(make_model(), steps=8, n_micro=2)
    s = store()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    with stream_weights(model.blocks, store=s) as h:
        for step in range(4):
            losses.append(torch.stack(forward_backward(model, batches(step, 2))))
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert h.closed and len(s) == 0
    for step in range(4, 8):
        losses.append(torch.stack(forward_backward(model, batches(step, 2))))
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert all(torch.equal(x, y) for x, y in zip(losses, ref[0]))


def test_gradients_are_on_the_host_between_passes_and_none_on_the_device(store, one_thread):
    s = store()
    model = make_model()
    h = stream_weights(model.blocks, store=s, prefetch_blocks=1)
    seen = []

    def spy(param):  # runs after the stream's hook: the device gradient is gone already
        seen.append(param.grad)

    model.blocks[2].fc.weight.register_post_accumulate_grad_hook(spy)
    forward_backward(model, batches(0, 2))
    assert seen == [None, None]
    g = model.blocks[2].fc.weight.grad
    assert g is not None and g.shape == model.blocks[2].fc.weight.shape
    host = {p.name: p.host for p in h._blocks[2].params}["fc.weight"]
    assert model.blocks[2].fc.weight.data_ptr() == host.data_ptr()  # the host copy itself
    h.close()
