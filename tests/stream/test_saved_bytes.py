"""What ``torch.save`` writes for a streamed model's state dict: the weights' bytes, not the pool
slabs under them (Note [exact state dict storage] in tiermem/stream/state_dicts.py, Note
[exact storage] in tiermem/store/exact.py).

With ``tier="cpu"`` a streamed weight's host copy is a view into a store slab shared with other
keys (here 4 MiB slabs; 256 MiB to 1 GiB at scale), and ``torch.save`` writes a tensor's whole
storage: ``torch.save(model.state_dict())`` of the small GPT below wrote 4.2 MB for 0.22 MB of
weights, with the bytes of every other key in the slab (a planted marker; HybridAdam's moments
when it shares the store, as examples/train_large.py does), and refused a model with two dtypes
in one slab. The saved file must now be as large as the same model's unstreamed state dict,
hold no byte of another key, load bit for bit, and resume training bit-identically; a state
dict held across ``close()`` keeps its values when the pool reuses the blocks.
"""

from __future__ import annotations

import io

import pytest
import torch

from tiermem.checkpoint import save_checkpoint
from tiermem.optim.hybrid_adam import HybridAdam
from tiermem.schedule.micro_batches import forward_backward
from tiermem.store.exact import exact_storage, owns_exactly
from tiermem.stream import stream_weights

from _stream_train import assert_same_steps, batches, frozen_gpt, make_model, step_snapshot

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster
STEPS = 8
MARKER = bytes(range(7, 256, 3)) * 16  # 1,312 bytes no weight holds
OVERHEAD = 512  # torch.save's bytes per entry beyond its data (measured: ~311) ...
BASE_OVERHEAD = 4096  # ... and per file


@pytest.fixture
def slabs(make_stream_store):
    """``slabs(nvme)``: a CPU store with 4 MiB slabs (every small key shares one), 32 MiB of
    RAM, no GPU budget; ``nvme``: a 64 MiB NVMe tier."""
    return lambda nvme=False: make_stream_store(gpu_bytes=0, cpu_bytes=32 << 20,
                                                pool_slab_bytes=4 << 20,
                                                **({"nvme_bytes": 64 << 20} if nvme else {}))


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loaded(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def _plant(store, stream, model):
    """Put a key holding ``MARKER`` into ``store``'s cpu tier; return it after checking the
    premise: with ``tier="cpu"`` it shares a slab with the first streamed weight."""
    store.put("marker", torch.frombuffer(bytearray(MARKER), dtype=torch.uint8), "cpu")
    if stream.tier == "cpu" and stream._home is None:
        marker = store.get("marker", "cpu")
        host = stream.host_copy(model.blocks[0].qkv.weight)
        assert marker.untyped_storage().data_ptr() == host.untyped_storage().data_ptr()
        assert host.untyped_storage().nbytes() >= 4 << 20  # the premise: a view into a slab


def _check_bytes(data: bytes, sd: dict, plain: int | None = None) -> None:
    """``data`` (``torch.save(sd)``) holds ``sd``'s bytes plus torch.save's small overhead, and
    no byte of the planted marker; ``plain``: the size the unstreamed model's file has."""
    weights = sum(t.nbytes for t in sd.values() if isinstance(t, torch.Tensor))
    assert len(data) <= weights + OVERHEAD * len(sd) + BASE_OVERHEAD, \
        f"saved {len(data)} bytes for {weights} bytes of tensors"
    assert MARKER[:64] not in data, "the file holds bytes of another key of the slab"
    if plain is not None:
        assert len(data) == plain


@pytest.mark.parametrize("tier,staging", [("cpu", None), ("nvme", None), ("nvme", 2)],
                         ids=["cpu", "nvme", "nvme-home"])
@pytest.mark.parametrize("when", ["between passes", "open pass"])
def test_saved_state_dict_is_the_weights_only(slabs, tier, staging, when):
    """``torch.save(model.state_dict())``, between passes and during a pass before its
    backward, is as large as the unstreamed model's file (the same tensors), holds no byte of
    the marker planted in the slab, and loads bit for bit into a fresh unstreamed model. Red on
    the old code with tier cpu (4.2 MB, marker included); nvme (host tensors of their own) and
    the NVMe home (its frozen weights left out) were already exact."""
    build = make_model if staging is None else frozen_gpt  # the NVMe home: a frozen base
    model = build()
    want = build().state_dict()  # the same weights, unstreamed (torch's OrderedDict)
    store = slabs(tier == "nvme")
    stream = stream_weights(model.blocks, store=store, tier=tier, prefetch_blocks=1,
                            staging_blocks=staging, frozen_only=staging is not None)
    try:
        _plant(store, stream, model)
        loss = None
        if when == "open pass":
            idx, targets = batches(0, 1)[0]
            _, loss = model(idx, targets)
            assert stream.in_pass
        sd = model.state_dict()
        data = _saved(sd)
        if staging is not None:  # the NVMe home's weights are left out
            for k in [k for k in want if k not in sd]:
                del want[k]
        assert sd.keys() == want.keys()
        _check_bytes(data, sd, len(_saved(want)))
        for k, v in sd.items():
            assert owns_exactly(v), k
        fresh = build(seed=1)
        fresh.load_state_dict(_loaded(data), strict=staging is None)
        for k, v in want.items():
            assert torch.equal(fresh.state_dict()[k], v), k
        if loss is not None:
            loss.backward()
    finally:
        stream.close(force=True)  # a failed check leaves the pass open


def _two_dtypes():
    """The GPT with its blocks' matrices in bf16 beside fp32 LayerNorms and biases."""
    model = make_model()
    for block in model.blocks:
        for p in block.parameters():
            if p.dim() == 2:
                p.data = p.data.to(torch.bfloat16)
    return model


def test_two_dtypes_in_one_slab_save_and_load(slabs):
    """bf16 matrices beside fp32 LayerNorms, all in one slab: torch.save refused the state
    dict ("Cannot save multiple tensors or storages that view the same data as different
    types": every entry's storage was the slab). Red on the old code; now it saves the weights
    and loads them bit for bit."""
    model, twin = _two_dtypes(), _two_dtypes()
    want = twin.state_dict()
    store = slabs()
    with stream_weights(model.blocks, store=store, tier="cpu", prefetch_blocks=1) as stream:
        _plant(store, stream, model)
        sd = model.state_dict()
        data = _saved(sd)
        _check_bytes(data, sd, len(_saved(want)))
        got = _loaded(data)
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in want.items()}
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def _hybrid(model, store):
    """HybridAdam stepping everything on the host, its state in ``store`` (shared with the
    stream, as examples/train_large.py shares one store)."""
    return HybridAdam(model.parameters(), lr=3e-3, weight_decay=0.1, offload_fraction=1.0,
                      chunk_numel=2048, store=store)


def _reference(slabs):
    """The independent run: not streamed, never saved, 8 steps of HybridAdam."""
    model = make_model()
    opt = _hybrid(model, slabs())
    try:
        return [step_snapshot(model, opt, forward_backward(model, batches(s, 1)))
                for s in range(STEPS)]
    finally:
        opt.close()


def test_resume_from_saved_bytes_continues_bit_identically(slabs, tmp_path):
    """One store for the streamed weights and HybridAdam's state (train_large's layout): the
    model's saved bytes at step 3 held the optimizer's moments (they share the slabs) and the
    planted marker; now they are the weights' size, hold neither, and so does
    ``save_checkpoint``'s file; a fresh model (other seed), store, stream and HybridAdam loaded
    from the bytes does steps 3-7 bit-identically to the uninterrupted unstreamed run, as does
    the saving run itself. Red on the old code (the size and the marker)."""
    want = _reference(slabs)
    k = 3
    model = make_model()
    store = slabs()
    stream = stream_weights(model.blocks, store=store, tier="cpu", prefetch_blocks=1)
    opt = _hybrid(model, store)
    got = []
    try:
        _plant(store, stream, model)
        for s in range(STEPS):
            losses = forward_backward(model, batches(s, 1))
            got.append(step_snapshot(model, opt, losses))
            if s == k - 1:
                sd = model.state_dict()
                model_bytes = _saved(sd)
                opt_sd = opt.state_dict()
                opt_bytes = _saved(opt_sd)
                moments = opt_sd["state"][2]["exp_avg"]  # blocks.0.ln1.weight's
                assert moments.abs().sum() > 0
                assert moments.numpy().tobytes()[:64] not in model_bytes, \
                    "the model's file holds the optimizer's moments"
                _check_bytes(model_bytes, sd)
                _check_bytes(opt_bytes, {f"{i}.{n}": t for i, st in opt_sd["state"].items()
                                         for n, t in st.items()})
                save_checkpoint(tmp_path / "ck.pt", model=model, optimizer=opt)
                ck = (tmp_path / "ck.pt").read_bytes()
                assert len(ck) <= len(model_bytes) + len(opt_bytes) + BASE_OVERHEAD
                assert MARKER[:64] not in ck
    finally:
        opt.close()
        stream.close()
    assert_same_steps(got, want, "saving run")
    model = make_model(seed=1)
    store = slabs()
    stream = stream_weights(model.blocks, store=store, tier="cpu", prefetch_blocks=1)
    opt = _hybrid(model, store)
    resumed = []
    try:
        model.load_state_dict(_loaded(model_bytes))
        opt.load_state_dict(_loaded(opt_bytes))
        for s in range(k, STEPS):
            resumed.append(step_snapshot(model, opt, forward_backward(model, batches(s, 1))))
    finally:
        opt.close()
        stream.close()
    assert_same_steps(resumed, want[k:], "resumed")
    assert not torch.equal(want[k][1]["blocks.0.qkv.weight"], want[-1][1]["blocks.0.qkv.weight"])


def test_hybrid_adam_state_dict_owns_its_bytes(slabs):
    """HybridAdam's ``state_dict()`` gathers its state into new tensors (the offloaded chunks
    are pool blocks, but nothing returned is a view of them): every tensor owns exactly its
    bytes and the saved state holds no byte of the marker planted in its slab. A guard: green
    on the old code too."""
    model = make_model()
    store = slabs()
    stream = stream_weights(model.blocks, store=store, tier="cpu", prefetch_blocks=1)
    opt = _hybrid(model, store)
    try:
        _plant(store, stream, model)
        for s in range(2):
            step_snapshot(model, opt, forward_backward(model, batches(s, 1)))
        sd = opt.state_dict()
        flat = {f"{i}.{n}": t for i, st in sd["state"].items() for n, t in st.items()}
        for name, t in flat.items():
            assert owns_exactly(t), name
        _check_bytes(_saved(sd), flat)
    finally:
        opt.close()
        stream.close()


@pytest.mark.parametrize("restore", [True, False])
def test_a_state_dict_held_across_close_keeps_its_values(slabs, restore):
    """``close()`` deletes the store keys and the pool hands their blocks to the next keys: an
    entry still pointing there showed their bytes (here a marker filling each reused block).
    Now each entry still alive gets its own copy at close, as a torch state dict keeps the old
    storage when ``param.data`` is replaced. Red on the old code."""
    model = make_model()
    store = slabs()
    stream = stream_weights(model.blocks, store=store, tier="cpu", prefetch_blocks=1)
    sd = model.state_dict()
    want = {k: v.clone() for k, v in sd.items()}
    block_keys = [k for k in sd if k.startswith("blocks.")]
    stream.close(restore=restore)
    fill = torch.frombuffer(bytearray(MARKER * 8), dtype=torch.uint8)
    for i, k in enumerate(block_keys):  # new keys the size of the freed blocks
        store.put(("after", i), fill[:sd[k].nbytes].clone(), "cpu")
    for k, v in want.items():
        assert torch.equal(sd[k], v), f"{k} changed after close()"
    assert MARKER[:64] not in _saved(sd)


def test_state_dict_entries_are_live_views_like_torchs(slabs):
    """Between passes the entries behave as torch's: each shares its parameter's version
    counter, so a write through it is an in-place change of the parameter (Note [param
    changes]) that the next forward streams; a later step shows in it; ``keep_vars=True``
    returns the parameters themselves. A guard that the swap to exact storage (no copy) kept
    torch's semantics: on the old code (``param.detach()`` over the slab) only its
    ``owns_exactly`` check is red."""
    model = make_model()
    ref = make_model()
    store = slabs()
    with stream_weights(model.blocks, store=store, tier="cpu", prefetch_blocks=1) as stream:
        sd = model.state_dict()
        w = model.blocks[1].fc.weight
        key = "blocks.1.fc.weight"
        assert owns_exactly(sd[key])
        assert sd[key].data_ptr() == stream.host_copy(w).data_ptr()  # no copy
        version = w._version
        with torch.no_grad():
            sd[key].mul_(0.5)
            ref.blocks[1].fc.weight.mul_(0.5)
        assert w._version != version
        idx, targets = batches(0, 1)[0]
        with torch.no_grad():
            assert torch.equal(model(idx, targets)[1], ref(idx, targets)[1])
        assert model.state_dict(keep_vars=True)[key] is w
        with torch.no_grad():
            w.add_(1.0)  # what an optimizer step does to the host copy
        assert torch.equal(sd[key], w)


def test_exact_storage_views_the_same_bytes():
    """The helper: a view into a larger storage (offset, non-contiguous, expanded) gets a
    storage of exactly its span over the same memory, which outlives the original's other
    references; a tensor owning its storage comes back as it is."""
    base = torch.arange(4096, dtype=torch.uint8)
    cases = [base[128:192].view(torch.float32).view(4, 4),
             base[256:416].view(torch.float32).view(8, 5).t(),
             base[64:68].view(torch.float32).expand(3, 2)]
    for t in cases:
        e = exact_storage(t)
        assert not owns_exactly(t) and owns_exactly(e)
        assert e.data_ptr() == t.data_ptr() and e.stride() == t.stride()
        assert torch.equal(e, t)
        assert len(_saved(e)) < len(_saved(t))
    kept = exact_storage(cases[0])
    del base, cases
    assert torch.equal(kept, torch.arange(128, 192, dtype=torch.uint8).view(torch.float32)
                       .view(4, 4))
    own = torch.ones(3)
    assert exact_storage(own).data_ptr() == own.data_ptr()
    assert owns_exactly(torch.empty(0)) and owns_exactly(torch.empty(2, device="meta"))


@pytest.mark.cuda
def test_entries_over_pinned_slabs_stay_pinned(tmp_path):
    """On CUDA the store's slabs are pinned: a state dict entry of exact storage over one is
    still pinned (pinned-ness is the address's), copies to the GPU asynchronously to the same
    values, and saves the weights' bytes only."""
    from tiermem import StoreConfig, TierStore
    model = make_model().cuda()
    with TierStore(StoreConfig(device="cuda", gpu_bytes=1 << 20, cpu_bytes=32 << 20,
                               pool_slab_bytes=4 << 20, nvme_bytes=0)) as store:
        with stream_weights(model.blocks, store=store, tier="cpu", prefetch_blocks=1):
            sd = model.state_dict()
            for k, v in sd.items():
                if k.startswith("blocks."):
                    assert v.device.type == "cpu" and v.is_pinned(), k
                    assert owns_exactly(v), k
                    on_gpu = v.to("cuda", non_blocking=True)
                    torch.cuda.current_stream().synchronize()  # the copy read v: wait for it
                    assert torch.equal(on_gpu.cpu(), v), k
            data = _saved(sd)
            assert len(data) <= sum(t.nbytes for t in sd.values()) + OVERHEAD * len(sd) \
                + BASE_OVERHEAD
