"""Note [NVMe home]: weights whose only home is NVMe (``stream_weights(..., tier="nvme",
staging_blocks=k)``; the LoRA base of ``stream_lora_base(tier="nvme")``) train bit-identically to
the loop without streaming, the RAM the stream holds stays within ``k`` blocks while the base is
several times larger, a failed read names the key and the spill file and leaves the stream
usable, and bad input gets one line naming the field, the value and the fix."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import types
import weakref

import pytest
import torch
from torch import nn

import tiermem.store.io.posix as posix_mod
from tiermem import StoreConfig, TierStore
from tiermem.store.nvme import SpillError
from tiermem.stream import stream_weights
from tiermem.stream.nvme_home import staging_bytes

from _stream_train import batches, fills_per_pass, frozen_gpt, train

pytestmark = pytest.mark.usefixtures("one_thread")

peft = pytest.importorskip("peft")

from tiermem.models.lora_llama import (SHAPES, adapter_parameters, decoder_layers,  # noqa: E402
                                       lora_batches, lora_llama)
from tiermem.models.lora_stream import stream_lora_base  # noqa: E402
from test_lora import ex  # noqa: E402, F401  (the examples/train_lora.py fixture)
from _lora_runs import assert_same_lora_run  # noqa: E402

STEPS = 8
SHAPE = dataclasses.replace(SHAPES["tiny"], layers=6)


def _lora_run(*, stream: dict | None, steps: int = STEPS, checkpoint: bool = True,
              layers: int = 6, on_fill=None, between=None):
    """Per-step (loss, adapters) of LoRA training (torch AdamW on the adapters, different
    batches each step), the base streamed with ``stream``'s options or not."""
    shape = dataclasses.replace(SHAPES["tiny"], layers=layers)
    model = lora_llama(shape, checkpoint=checkpoint, seed=0)
    handle = store = None
    if stream is not None:
        handle, store = stream_lora_base(model, device="cpu", **stream)
        if on_fill is not None:
            handle._fetcher.fault = lambda b, p, src: (on_fill(handle, store), src)[1]
    opt = _adamw(model)
    out = []
    try:
        for ids in lora_batches(shape.vocab, 2, 16, steps):
            out.append(_step(model, opt, ids))
            if between is not None:
                between(handle, store, model)
        stats = handle.stats() if handle is not None else None
    finally:
        if handle is not None:
            handle.close()
            store.close()
    return out, stats, model


def _adamw(model):
    return torch.optim.AdamW(adapter_parameters(model), lr=2e-3, weight_decay=0.01)


def _step(model, opt, ids):
    """One optimizer step on the batch ``ids``: its ``(loss, [adapters after the step])``."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach().clone(), [p.detach().clone() for p in adapter_parameters(model)]


@pytest.mark.parametrize("prefetch,staging,ckpt", [(1, None, True), (0, 1, False), (2, 2, True)])
def test_a_lora_base_homed_on_nvme_trains_bit_identical(tmp_path, prefetch, staging, ckpt):
    ref, _, _ = _lora_run(stream=None, checkpoint=ckpt)
    stand_ins = []

    def between(handle, store, model):  # between passes: no RAM copy, a stride-0 stand-in
        stand_ins.append(all(p.param.data.stride() == (0,) * p.param.dim()
                             and p.param.data.untyped_storage().nbytes() <= 8
                             for b in handle._blocks for p in b.params))

    got, stats, model = _lora_run(stream=dict(tier="nvme", nvme_dir=str(tmp_path),
                                              prefetch_blocks=prefetch, staging_blocks=staging),
                                  checkpoint=ckpt, between=between)
    assert_same_lora_run(got, ref, STEPS)
    assert stand_ins == [True] * STEPS
    k = staging if staging is not None else prefetch + 2
    assert stats["fills"] == fills_per_pass(6, prefetch) * STEPS
    assert 1 <= stats["staging_peak_blocks"] <= k
    assert stats["nvme_writes"] == 0  # nobody writes a frozen base
    # close() put the base back: every weight equals a fresh model's
    fresh = dict(lora_llama(SHAPE, checkpoint=ckpt, seed=0).named_parameters())
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, fresh[name]), name


@pytest.mark.parametrize("block_major", [False, True])
def test_a_frozen_gpt_base_on_nvme_is_exact_depth_first_and_block_major(make_stream_store,
                                                                        block_major):
    """The read-ahead follows execution order in both schedules (forward, then backward in
    reverse; block-major's two phases): 8 AdamW steps x 2 micro-batches bit-equal."""
    from tiermem.schedule.micro_batches import forward_backward

    store = make_stream_store(cpu_bytes=4 << 20, nvme_bytes=16 << 20)
    ref = train(frozen_gpt(), steps=STEPS, n_micro=2)
    handles = []

    def stream(m):
        handles.append(stream_weights(m.blocks, store=store, tier="nvme", prefetch_blocks=1,
                                      frozen_only=True, staging_blocks=2))
        return handles[0]

    fb = (lambda m, b: forward_backward(m, b, block_major=True)) if block_major \
        else forward_backward
    model = frozen_gpt()
    got = train(model, steps=STEPS, n_micro=2, stream=stream, fb=fb)
    for step, (x, y) in enumerate(zip(got[0], ref[0])):
        assert torch.equal(x, y), f"step {step}"
    st = handles[0].stats()
    passes = 1 if block_major else 2
    assert st["fills"] == fills_per_pass(4, 1) * passes * STEPS
    assert st["staging_peak_blocks"] <= 2 and st["read_ahead_blocks"] > 0
    handles[0].close()
    final = model.state_dict()  # the frozen weights read back from NVMe by close()
    for k, v in ref[1].items():
        assert torch.equal(final[k], v), k


def _host_bytes_held(handle, store) -> int:
    """Bytes of CPU tensors and storages reachable from the stream object, not through the
    store (its pool is counted by the store's own peak) nor through modules (the model's
    resident adapters): what the stream itself holds in RAM."""
    seen, stack, held = set(), [handle], {}
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is store or isinstance(obj, (nn.Module, type,
                                                               types.ModuleType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "cpu":
                s = obj.untyped_storage()
                held[s.data_ptr()] = s.nbytes()
            continue
        if isinstance(obj, torch.UntypedStorage):
            if obj.device.type == "cpu":
                held[obj.data_ptr()] = obj.nbytes()
            continue
        if isinstance(obj, types.FunctionType):  # its closure, not its module's globals
            for cell in obj.__closure__ or ():
                with contextlib.suppress(ValueError):
                    stack.append(cell.cell_contents)
            continue
        stack.extend(gc.get_referents(obj))
    return sum(held.values())


def test_ram_held_by_the_stream_stays_within_the_staging_bound(tmp_path):
    """16 layers, 3 of staging (prefetch 1 + 2): the store's RAM never holds more than 3
    layers, at any fill and at its peak over the run (placement and close() included), and the
    stream object holds no host copy: between steps the CPU bytes reachable from it are the
    stand-ins' (one element per weight)."""
    layers = 16
    model = lora_llama(dataclasses.replace(SHAPES["tiny"], layers=layers), seed=0)
    sizes = [[p.numel() * p.element_size() for p in layer.parameters() if not p.requires_grad]
             for layer in decoder_layers(model)]
    base = sum(map(sum, sizes))
    bound = staging_bytes(sizes, 3)
    assert base >= 5 * bound  # the base is several times the staging
    at_fills, between = [], []
    got, stats, _ = _lora_run(
        stream=dict(tier="nvme", nvme_dir=str(tmp_path), prefetch_blocks=1), layers=layers,
        on_fill=lambda h, s: at_fills.append(s.used_bytes("cpu")),
        between=lambda h, s, m: between.append((_host_bytes_held(h, s), s.stats())))
    assert at_fills and max(at_fills) <= bound
    n_weights = sum(len(s) for s in sizes)
    for held, st in between:
        assert held <= 16 * n_weights, held  # stand-ins and checksums: no copy of the base
        assert st["cpu"]["peak_bytes"] <= bound  # the placement's writes included
    assert stats["staging_peak_bytes"] <= bound


def test_the_ram_bound_check_can_fail(tmp_path):
    """Must go red: the same measurement sees the RAM host copies of a stream without
    staging_blocks (the nvme tier before Note [NVMe home])."""
    model = lora_llama(SHAPE, seed=0)
    store = TierStore(StoreConfig(device="cpu", gpu_bytes=0, cpu_bytes=4 << 20,
                                  nvme_bytes=16 << 20, nvme_dir=str(tmp_path),
                                  pool_slab_bytes=1 << 20))
    try:
        handle = stream_weights(decoder_layers(model), store=store, tier="nvme",
                                frozen_only=True)
        base = sum(p.numel() * p.element_size() for layer in decoder_layers(model)
                   for p in layer.parameters() if not p.requires_grad)
        assert _host_bytes_held(handle, store) >= base
        handle.close()
    finally:
        store.close()


def test_a_failed_read_names_key_and_file_and_the_stream_stays_usable(tmp_path, monkeypatch):
    """EIO on every NVMe read from step 3 on (after the store's retries): the step raises the
    store's SpillError naming the stream's key and the spill file; nothing stays held or
    staged, no pass is open; once the disk reads again the same step reruns and the whole run
    equals the one without streaming, bit for bit."""
    ref, _, _ = _lora_run(stream=None, checkpoint=False)
    model = lora_llama(SHAPE, seed=0)
    handle, store = stream_lora_base(model, device="cpu", tier="nvme", nvme_dir=str(tmp_path))
    spill_file = store._spill.path
    opt = _adamw(model)
    real = posix_mod.os.preadv
    failures, out = [], []

    def eio(*a, **k):
        raise OSError(errno.EIO, "Input/output error (injected)")

    try:
        for step, ids in enumerate(lora_batches(SHAPE.vocab, 2, 16, STEPS)):
            if step == 3:
                monkeypatch.setattr(posix_mod.os, "preadv", eio)
                with pytest.raises(SpillError) as info:
                    model(input_ids=ids, labels=ids).loss.backward()
                failures.append(info.value)
                assert not handle.in_pass
                assert store.used_bytes("cpu") == 0  # nothing held, nothing staged
                assert handle._home.stats["staging_peak_blocks"] >= 1
                opt.zero_grad(set_to_none=True)
                monkeypatch.setattr(posix_mod.os, "preadv", real)  # the disk recovers
            out.append(_step(model, opt, ids))
    finally:
        handle.close()
        store.close()
    err = failures[0]
    assert err.key[:2] == ("tiermem.stream", handle._uid) and err.path == spill_file
    assert repr(err.key) in str(err) and spill_file in str(err) and err.errno == errno.EIO
    assert_same_lora_run(out, ref, STEPS)


def test_a_truncated_spill_file_names_key_and_file_and_close_leaves_the_stream_open(tmp_path):
    """The NVMe file cut short mid-run (the base's only copy is gone): the next forward raises
    SpillCorruption naming a stream key and the file, no pass stays open, and close(), which
    would read the base back, raises the same way and leaves the stream open (nothing changed);
    the store still closes."""
    import os

    from tiermem.store.nvme import SpillCorruption

    model = lora_llama(SHAPE, seed=0)
    handle, store = stream_lora_base(model, device="cpu", tier="nvme", nvme_dir=str(tmp_path))
    ids = lora_batches(SHAPE.vocab, 2, 16, 1)[0]
    try:
        model(input_ids=ids, labels=ids).loss.backward()
        spill = store._spill.path
        os.truncate(spill, 4096)
        with pytest.raises(SpillCorruption) as info:
            model(input_ids=ids, labels=ids).loss.backward()
        assert info.value.key[0] == "tiermem.stream" and info.value.path == spill
        assert spill in str(info.value) and not handle.in_pass
        with pytest.raises(SpillCorruption):
            handle.close()
        assert not handle.closed
        assert all(p.param.data.stride() == (0,) * p.param.dim()
                   for b in handle._blocks for p in b.params)  # still the stand-ins
    finally:
        store.close()


def test_out_of_order_calls_are_still_refused(make_stream_store):
    store = make_stream_store(cpu_bytes=4 << 20, nvme_bytes=16 << 20)
    model = frozen_gpt()
    plain = frozen_gpt()
    handle = stream_weights(model.blocks, store=store, tier="nvme", frozen_only=True,
                            staging_blocks=1)
    x = torch.randn(2, 16, 32)
    with pytest.raises(RuntimeError, match=r"blocks\[1\] called first in a forward pass"):
        model.blocks[1](x)
    with torch.no_grad():
        y = model.blocks[0](x)
        with pytest.raises(RuntimeError, match=r"blocks\[2\] called before blocks\[1\]"):
            model.blocks[2](y)
    assert store.used_bytes("cpu") <= staging_bytes(
        [[p.numel() * 4 for p in b.parameters() if p.dim() == 2] for b in plain.blocks], 1)
    with torch.no_grad():  # a pass in order works and equals the model without streaming
        a, b = x, x
        for blk, ref_blk in zip(model.blocks, plain.blocks):
            a, b = blk(a), ref_blk(b)
    assert torch.equal(a, b)
    handle.close()


def test_bad_input_gets_one_line_naming_field_value_and_fix(make_stream_store):
    store = make_stream_store(cpu_bytes=128 << 10, nvme_bytes=16 << 20)  # 2 blocks, not 3
    m = frozen_gpt()
    cases = [
        (dict(tier="nvme", staging_blocks=2), ValueError,
         r"staging_blocks=2 keeps no RAM copy of blocks\[0\]\.ln1\.weight, which requires "
         r"grad .* fix: frozen_only=True"),
        (dict(tier="cpu", staging_blocks=2, frozen_only=True), ValueError,
         r"staging_blocks=2 bounds the RAM staging .* fix: tier='nvme'"),
        (dict(tier="nvme", staging_blocks=0, frozen_only=True), ValueError,
         r"staging_blocks=0 must be an int >= 1"),
        (dict(tier="nvme", staging_blocks="2", frozen_only=True), TypeError,
         r"staging_blocks must be an int >= 1"),
        (dict(tier="nvme", staging_blocks=3, frozen_only=True), ValueError,
         r"staging_blocks=3 stages up to 147456 bytes .* StoreConfig\.cpu_bytes=131072; fix: "
         r"raise cpu_bytes to at least 147456 or lower staging_blocks"),
    ]
    for kw, exc, pattern in cases:
        with pytest.raises(exc, match=pattern) as info:
            stream_weights(m.blocks, store=store, **kw)
        assert "\n" not in str(info.value)
        assert len(store) == 0  # nothing placed
    handle = stream_weights(m.blocks, store=store, tier="nvme", staging_blocks=2,
                            frozen_only=True)
    w = m.blocks[1].qkv.weight
    with pytest.raises(ValueError, match=r"has no host copy: its home is NVMe"):
        handle.host_copy(w)
    with torch.no_grad(), pytest.raises(RuntimeError, match="more than one element"):
        w.mul_(2)  # torch refuses the write into the stand-in
    with torch.no_grad():
        w.fill_(0.5)  # a write torch lets through: the next pass start refuses it
    with pytest.raises(ValueError, match=r"was written in place between passes .* fix: assign"):
        m(batches(0, 1)[0][0])
    new = torch.full(w.shape, 0.25)
    w.data = new  # the fix: replaced data is written to the NVMe home
    with torch.no_grad():
        m(batches(0, 1)[0][0])
    assert torch.isnan(w).all()  # a fresh stand-in, not the one fill_ wrote
    w.data = w.data.clone()  # a copy of the stand-in (what model.to() makes) is refused
    with pytest.raises(ValueError, match=r"qkv\.weight\.data was replaced by a tensor of NaN "
                                         r"only, a copy of its stand-in .* fix: leave"):
        m(batches(0, 1)[0][0])
    assert w.stride() == (0, 0)  # the stand-in again: the NVMe copy (0.25) was kept
    plain = frozen_gpt()
    dict(plain.named_parameters())[_name_of(m, w)].data.copy_(new)
    idx = batches(0, 1)[0][0]
    with torch.no_grad():
        assert torch.equal(m(idx)[0], plain(idx)[0])
    handle.close()
    assert torch.equal(w, new)


def _name_of(model, param):
    return next(n for n, p in model.named_parameters() if p is param)


def test_the_entry_point_streams_the_base_from_nvme_with_bounded_ram(ex, capsys, tmp_path):
    """examples/train_lora.py --stream-tier nvme --nvme-dir DIR --staging-blocks 2: the same
    losses as the baseline (exit 0) and the RAM staging printed."""
    code = ex.main(["--compare", "--stream-weights", "--stream-tier", "nvme", "--nvme-dir",
                    str(tmp_path), "--staging-blocks", "2", "--steps", "8", "--seq", "16"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "streamed from nvme, prefetch 1, depth-first, 2 layers of RAM staging" in out
    assert "RAM staging peak" in out and "max |loss difference|: 0 " in out


@pytest.mark.parametrize("argv,needle", [
    (["--stream-weights", "--stream-tier", "nvme", "--nvme-dir", ".", "--staging-blocks", "0"],
     "--staging-blocks=0 must be an int >= 1"),
    (["--stream-weights", "--staging-blocks", "2"],
     "--staging-blocks=2 bounds the RAM staging of a base on NVMe; fix: add --stream-tier nvme"),
    (["--staging-blocks", "2"], "--staging-blocks=2 sets how the base streams; fix: add "
                                "--stream-weights"),
    (["--stream-weights", "--layerwise-base"],
     "--layerwise-base builds the base layer by layer into its NVMe home; fix: add "
     "--stream-weights --stream-tier nvme"),
])
def test_bad_staging_flags_get_one_line_and_exit_2(ex, capsys, argv, needle):
    assert ex.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("train_lora: error: ") and err.count("\n") == 1, err
    assert needle in err, err


# ---------------------------------------------------------------- Note [layer-wise NVMe base]


def test_a_base_built_layer_by_layer_into_nvme_trains_bit_identical(tmp_path):
    """layerwise_lora_llama's layers made one at a time straight into the stream's NVMe home
    (at most one layer's tensors alive at any time) train like the same weights built whole
    and not streamed: 8 steps, every loss and adapter; after close() the base is stand-ins."""
    from tiermem.models.lora_layerwise import layerwise_lora_llama

    def run(stream: bool):
        model, layer_weights = layerwise_lora_llama(SHAPE, checkpoint=True,
                                                    materialize=not stream)
        alive, calls = [], []

        def tracked(i):
            gc.collect()
            calls.append((i, sum(r() is not None for r in alive)))  # earlier layers' tensors
            out = layer_weights(i)
            alive.extend(weakref.ref(t) for t in out.values())
            return out

        handle = store = None
        if stream:
            handle, store = stream_lora_base(model, device="cpu", tier="nvme",
                                             nvme_dir=str(tmp_path), load_block=tracked)
            assert calls == [(i, 0) for i in range(SHAPE.layers)]
        opt = _adamw(model)
        out = [_step(model, opt, ids) for ids in lora_batches(SHAPE.vocab, 2, 16, STEPS)]
        if handle is not None:
            assert handle.stats()["staging_peak_blocks"] <= 3
            handle.close()
            store.close()
            assert all(p.stride() == (0,) * p.dim()
                       for p in model.parameters() if not p.requires_grad and p.dim()
                       and any(p is q for layer in decoder_layers(model)
                               for q in layer.parameters()))
        return out

    assert_same_lora_run(run(True), run(False), STEPS)


def test_load_block_gets_one_line_errors_and_places_nothing(make_stream_store):
    store = make_stream_store(cpu_bytes=1 << 20, nvme_bytes=16 << 20)
    m = frozen_gpt()
    shapes = {n: p for n, p in m.blocks[1].named_parameters() if p.dim() == 2}

    def wrong(i):
        return {n: torch.zeros(3) for n in shapes}

    cases = [
        (dict(load_block=lambda i: {}), ValueError,
         r"load_block builds weights whose only home is NVMe; fix: give staging_blocks"),
        (dict(staging_blocks=2, load_block=3), TypeError, r"load_block must be a callable"),
        (dict(staging_blocks=2, load_block=wrong), ValueError,
         r"load_block\(0\) gave a torch.float32 tensor of shape \(3,\) for 'qkv.weight'; fix: "
         r"give the torch.float32 tensor of shape \(96, 32\) under that name"),
    ]
    for kw, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            stream_weights(m.blocks, store=store, tier="nvme", frozen_only=True, **kw)
        assert len(store) == 0
        assert all(p.data.stride() != (0, 0) for p in shapes.values())  # unchanged


def test_the_entry_point_builds_the_base_layer_by_layer(ex, capsys, tmp_path):
    code = ex.main(["--compare", "--stream-weights", "--stream-tier", "nvme", "--nvme-dir",
                    str(tmp_path), "--layerwise-base", "--steps", "8", "--seq", "16"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "max |loss difference|: 0 " in out
