"""Bad input to weight streaming gets one clear error, and the stream stays usable."""

from __future__ import annotations

import pytest
import torch
from _stream_train import CFG, batches, make_model
from torch import nn

from tiermem import StoreConfig, TierStore
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster


@pytest.fixture
def store(make_stream_store):
    return make_stream_store(cpu_bytes=8 << 20, nvme_bytes=8 << 20, io_threads=1)


def _x(model, step=0):
    idx, _ = batches(step, 1)[0]
    return model.embed(idx)


def test_a_block_called_twice_in_a_pass_is_refused(store):
    model = make_model()
    with stream_weights(model.blocks, store=store):
        with torch.no_grad():
            x = _x(model)
            x = model.blocks[0](x)
            x = model.blocks[1](x)
            with pytest.raises(RuntimeError, match=r"blocks\[1\] called twice in one forward"):
                model.blocks[1](x)
            with pytest.raises(RuntimeError, match=r"blocks\[3\] called before blocks\[2\]"):
                model.blocks[3](x)
            for i in (2, 3):  # the pass goes on where it was
                x = model.blocks[i](x)


def test_a_pass_must_begin_with_the_first_block(store):
    model = make_model()
    with stream_weights(model.blocks, store=store):
        with pytest.raises(RuntimeError, match=r"blocks\[2\] called first"):
            model.blocks[2](_x(model))


def test_a_second_forward_while_the_graph_is_alive_is_refused(store):
    model = make_model()
    with stream_weights(model.blocks, store=store):
        idx, tgt = batches(0, 1)[0]
        _, loss = model(idx, tgt)
        with pytest.raises(RuntimeError, match=r"graph is alive and its backward has not run"):
            model(idx, tgt)
        loss.backward()
        logits, loss = model(idx, tgt)  # after the backward: a new pass
        del logits, loss  # the graph is dropped: the next forward may begin
        model(idx, tgt)[1].backward()
        with torch.no_grad():
            model(idx, tgt)  # evaluation passes end by themselves


def test_leaving_the_context_on_an_error_ends_an_open_pass(store):
    model = make_model()
    idx, tgt = batches(0, 1)[0]
    with pytest.raises(KeyError):
        with stream_weights(model.blocks, store=store) as h:
            _, loss = model(idx, tgt)
            raise KeyError("user code failed")
    assert h.closed and len(store) == 0
    with pytest.raises(RuntimeError, match="graph whose pass has ended"):
        loss.backward()
    model(idx, tgt)[1].backward()  # an ordinary model again


def test_a_second_backward_through_a_retained_graph_is_refused(store):
    model = make_model()
    with stream_weights(model.blocks, store=store):
        idx, tgt = batches(0, 1)[0]
        _, loss = model(idx, tgt)
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="graph whose pass has ended"):
            loss.backward()


def test_meta_weights_are_refused(store):
    with torch.device("meta"):
        model = make_model()
    with pytest.raises(ValueError, match=r"blocks\[0\]\.ln1\.weight is on the meta device.*"
                                         r"to_empty"):
        stream_weights(model.blocks, store=store)


def test_tied_weights_across_blocks_are_refused(store):
    model = make_model()
    model.blocks[2].fc.weight = model.blocks[0].fc.weight
    with pytest.raises(ValueError, match=r"blocks\[2\]\.fc\.weight is the same parameter as "
                                         r"blocks\[0\]\.fc\.weight \(tied"):
        stream_weights(model.blocks, store=store)
    model = make_model()
    model.blocks[1].fc.weight.data = model.blocks[0].fc.weight.data  # aliased memory
    with pytest.raises(ValueError, match="shares its memory with blocks"):
        stream_weights(model.blocks, store=store)
    model = make_model()
    with pytest.raises(ValueError, match=r"blocks\[1\] is the same module as blocks\[0\]"):
        stream_weights(nn.ModuleList([model.blocks[0], model.blocks[0]]), store=store)
    assert len(store) == 0  # nothing was placed


def test_a_block_streamed_twice_is_refused(store):
    model = make_model()
    with stream_weights(model.blocks, store=store):
        with pytest.raises(ValueError, match="streamed already"):
            stream_weights(model.blocks[2:], store=store)
    stream_weights(model.blocks, store=store).close()  # after close() it may be streamed again


@pytest.mark.parametrize("kw,exc,match", [
    ({"tier": "gpu"}, ValueError, "tier='gpu' is unknown"),
    ({"prefetch_blocks": -1}, ValueError, "prefetch_blocks=-1"),
    ({"gpu_bytes": 100}, ValueError, "gpu_bytes=100 cannot hold these blocks"),
    ({"gpu_bytes": "1MiB", "resident": [3]}, ValueError, "not both"),
    ({"resident": [4]}, ValueError, "there are 4 blocks"),
    ({"store": object()}, TypeError, "must be a tiermem.TierStore"),
])
def test_bad_options(store, kw, exc, match):
    model = make_model()
    args = {"store": store} | kw
    with pytest.raises(exc, match=match):
        stream_weights(model.blocks, **args)
    assert len(store) == 0


def test_nvme_tier_needs_an_nvme_store():
    model = make_model()
    with TierStore(StoreConfig(device="cpu", cpu_bytes=1 << 20, pool_slab_bytes=1 << 20)) as s:
        with pytest.raises(ValueError, match="tier='nvme' needs a store with an nvme tier"):
            stream_weights(model.blocks, store=s, tier="nvme")


def test_a_store_too_small_changes_nothing():
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    with TierStore(StoreConfig(device="cpu", cpu_bytes=64 << 10, pool_slab_bytes=64 << 10)) as s:
        with pytest.raises(MemoryError):  # TierFullError
            stream_weights(model.blocks, store=s)
        assert len(s) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    model(*batches(0, 1)[0])[1].backward()  # still an ordinary model


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_weight_changed_during_a_pass_is_refused(store, tier):
    """Between a block's forward and its backward the host copy must not change: the forward
    used the old values (an alias taken between passes shares the version counter)."""
    model = make_model()
    alias = model.blocks[1].fc.weight.detach()  # taken before streaming
    with stream_weights(model.blocks, store=store, tier=tier):
        alias = model.blocks[1].fc.weight.detach()  # between passes: the host copy
        idx, tgt = batches(0, 1)[0]
        _, loss = model(idx, tgt)
        with torch.no_grad():
            alias.mul_(2.0)
        with pytest.raises(RuntimeError, match=r"blocks\[1\]\.fc\.weight was changed in place "
                                               r"during the forward/backward pass"):
            loss.backward()
    assert len(store) == 0  # the failed backward ended the pass: close() worked


def test_optimizer_step_during_a_pass_is_refused(store):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with stream_weights(model.blocks, store=store):
        idx, tgt = batches(0, 1)[0]
        _, loss = model(idx, tgt)
        with pytest.raises(RuntimeError, match=r"AdamW.step\(\) during a weight-streaming pass"):
            opt.step()
        loss.backward()
        opt.step()  # after the backward it steps the host copies
        assert model.blocks[0].fc.weight.grad.device.type == "cpu"


def test_replaced_data_of_another_shape_is_refused(store):
    model = make_model()
    with stream_weights(model.blocks, store=store):
        w = model.blocks[0].fc.weight
        w.data = torch.zeros(3, 3)
        with pytest.raises(ValueError, match=r"blocks\[0\]\.fc\.weight\.data was replaced.*"
                                             r"copy new values in"):
            model(*batches(0, 1)[0])
        w.data = torch.zeros(CFG.mlp_ratio * CFG.d_model, CFG.d_model)
        model(*batches(0, 1)[0])[1].backward()


def test_a_failed_forward_leaves_the_stream_usable(store):
    model = make_model()
    with stream_weights(model.blocks, store=store) as h:
        with pytest.raises(RuntimeError):
            model.blocks[0](torch.zeros(2, CFG.seq_len, CFG.d_model + 1))  # wrong width
        assert not h.in_pass
        forward_backward(model, batches(0, 2))
        assert not h.in_pass and model.blocks[0].fc.weight.grad is not None
