"""Activation offload: gradients equal to PyTorch's, keys freed, budgets held, errors named.

CPU tests compare gradients with ``torch.equal`` against the same model run without offload
(same seeds). CUDA tests (``-m cuda``) widen timing windows with ``torch.cuda._sleep`` on the
copy streams and measure peak device memory. See Note [offload rules] in
tiermem/offload/rules.py for the behaviour checked here.
"""

from __future__ import annotations

import gc
import random
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from torch import nn

from models import TinyGPT, make_batch
from tiermem import StoreConfig, TierStore
from tiermem.offload import LayerPolicy, offload_activations, resolve_layers
from tiermem.offload.activations import ActivationOffloader

# ---------------------------------------------------------------------------------- helpers


pytestmark = pytest.mark.usefixtures("one_thread")


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _assert_equal_grads(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"gradient {i} differs (max abs diff {(x - y).abs().max()})"


def _run(model_fn, steps, device="cpu", offload=None):
    """Build a model (seed 0), run ``steps(model)`` (inside ``offload(model)`` if given)."""
    torch.manual_seed(0)
    model = model_fn().to(device)
    if offload is None:
        steps(model)
        return model, None
    off = offload(model)
    with off:
        steps(model)
    return model, off


def _train_step(seed=1, device="cpu", **batch):
    def steps(model):
        idx, targets = make_batch(seed, device=device, **batch)
        _, loss = model(idx, targets)
        loss.backward()
    return steps


def _assert_clean(store: TierStore, off: ActivationOffloader) -> None:
    assert len(store) == 0, f"leaked keys: {store.keys()[:5]}"
    assert off.live_keys == 0
    stats = store.stats()
    for tier in ("gpu", "cpu", "nvme"):
        assert stats[tier]["used_bytes"] == 0
        assert stats[tier]["peak_bytes"] <= stats[tier]["budget_bytes"], tier


# ---------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("num_layers", [0, 2, 3])
@pytest.mark.parametrize("prefetch_depth", [1, 3])
def test_tinygpt_gradients_equal(make_store, tier, num_layers, prefetch_depth):
    ref, _ = _run(TinyGPT, _train_step())
    store = make_store()
    model, off = _run(TinyGPT, _train_step(), offload=lambda m: offload_activations(
        m.blocks, store=store, tier=tier, num_layers=num_layers, prefetch_depth=prefetch_depth))
    _assert_equal_grads(_grads(ref), _grads(model))
    stats = off.stats()
    if num_layers:
        assert stats["offloaded"] > 0 and stats["reloads"] > 0
        moved = store.stats()["moved_bytes"]
        assert moved.get("cpu->nvme" if tier == "nvme" else "cpu->gpu", 0) > 0
    else:
        assert stats["offloaded"] == 0
    _assert_clean(store, off)


@pytest.mark.parametrize("layers", [[0, 1, 2, 3], [3], [1, 3]])
def test_explicit_layers_including_the_last(make_store, layers):
    ref, _ = _run(TinyGPT, _train_step())
    store = make_store()
    groups = []

    def steps(model):
        idx, targets = make_batch(1)
        _, loss = model(idx, targets)
        groups.extend(off._groups)
        loss.backward()

    torch.manual_seed(0)
    model = TinyGPT()
    with offload_activations(model.blocks, store=store, layers=layers) as off:
        steps(model)
    _assert_equal_grads(_grads(ref), _grads(model))
    assert {layer for _, layer in groups} == set(layers)
    _assert_clean(store, off)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_checkpointed_blocks_offload_only_block_inputs(make_store, tier):
    make = lambda: TinyGPT(checkpoint_blocks=True)  # noqa: E731
    ref, _ = _run(make, _train_step())
    plain, _ = _run(TinyGPT, _train_step())
    _assert_equal_grads(_grads(ref), _grads(plain))  # checkpointing itself is exact here
    store = make_store()
    model, off = _run(make, _train_step(), offload=lambda m: offload_activations(
        m.blocks, store=store, tier=tier, layers=[0, 1, 2, 3]))
    _assert_equal_grads(_grads(ref), _grads(model))
    stats = off.stats()
    # one saved tensor per block: its input (batch 4 x seq 16 x d_model 32 fp32 = 8 KiB)
    assert stats["offloaded"] == 4 and stats["put_bytes"] == 4 * 4 * 16 * 32 * 4
    _assert_clean(store, off)


def test_double_buffering_gradients_equal_and_buffers_reused(make_store):
    ref, _ = _run(TinyGPT, _train_step())
    store = make_store()
    model, off = _run(lambda: TinyGPT(n_layers=6), _train_step(),
                      offload=lambda m: offload_activations(m.blocks, store=store,
                                                            double_buffering=True))
    ref6, _ = _run(lambda: TinyGPT(n_layers=6), _train_step())
    _assert_equal_grads(_grads(ref6), _grads(model))
    stats = off.stats()
    assert stats["buffer_loads"] == 5  # every offloaded layer loaded into a set
    assert stats["buffer_fallbacks"] == 0
    assert ref is not None
    _assert_clean(store, off)


def test_double_buffering_falls_back_when_a_set_was_reused(make_store):
    """A record whose set was overwritten is read from the store again (Note [offload rules], rule 6)."""
    store = make_store()
    from tiermem.offload.activations import _Record
    from tiermem.offload.double_buffer import DoubleBuffer
    buffers = DoubleBuffer(store.device)
    recs = []
    for i in range(3):
        store.put(("k", i), torch.full((1000,), i, dtype=torch.uint8), tier="cpu")
        recs.append(_Record(("k", i), 1000, i, None, 0, live=1))
    for rec in recs:
        buffers.load([rec], store)
    assert buffers.view(recs[0]) is None and buffers.fallbacks == 1  # set 0 now holds recs[2]
    assert torch.equal(buffers.view(recs[2]), torch.full((1000,), 2, dtype=torch.uint8))
    assert torch.equal(buffers.view(recs[1]), torch.full((1000,), 1, dtype=torch.uint8))
    buffers.close(store, keep_buffers=False)


# ---------------------------------------------------------------------------------- shared tensors and views


class _SharingBlock(nn.Module):
    """Saves one tensor in two ops, a transpose view (matmul), a slice (mul) and a dtype view."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.w2 = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w1)          # h saved by tanh (output) ...
        a = h @ self.w2                      # ... and by this matmul: same storage, stored once
        b = h * h                            # ... and twice more here
        t = h.transpose(-1, -2)              # a transposed view saved by matmul
        c = (t @ h).sum(-1, keepdim=True).transpose(-1, -2)
        s = h[..., : h.shape[-1] // 2]       # a slice view saved by mul
        s = torch.cat([s * s, s], dim=-1)
        return a + b + c + s * self.scale    # the buffer is skipped (not offloaded)


def test_shared_tensors_and_views_are_stored_once_and_come_back_as_views(make_store):
    make = lambda: nn.Sequential(*[_SharingBlock(32) for _ in range(3)])  # noqa: E731

    def steps(model):
        x = torch.randn(8, 32, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
        model(x).square().mean().backward()

    ref, _ = _run(make, steps)
    store = make_store()
    seen = []
    orig = ActivationOffloader._unpack

    def spy(self, handle):
        out = orig(self, handle)
        if getattr(handle, "record", None) is not None:
            seen.append((handle.record.key, out.size(), out.stride(), out.storage_offset(),
                         out.untyped_storage().data_ptr()))
        return out

    ActivationOffloader._unpack = spy
    try:
        model, off = _run(make, steps, offload=lambda m: offload_activations(
            list(m), store=store, layers=[0, 1, 2]))
    finally:
        ActivationOffloader._unpack = orig
    _assert_equal_grads(_grads(ref), _grads(model))
    stats = off.stats()
    assert stats["deduplicated"] >= 3 * 3, stats
    # views of one key come back on one storage, with their original geometry
    by_key: dict = {}
    for key, size, stride, offset, ptr in seen:
        by_key.setdefault(key, set()).add(ptr)
    assert any(len(v) == 1 for v in by_key.values())
    assert any(stride != tuple(torch.empty(size).stride()) for _, size, stride, _, _ in seen)
    assert any(offset != 0 or size[-1] == 16 for _, size, _, offset, _ in seen)
    _assert_clean(store, off)


def test_parameters_buffers_and_small_tensors_are_skipped(make_store):
    store = make_store()
    model = _SharingBlock(32)
    x = torch.randn(2, 32, 32, requires_grad=True)
    with offload_activations([model], store=store, layers=[0],
                             min_offload_bytes=2 * 32 * 32 * 4 + 1) as off:
        model(x).sum().backward()
    assert off.stats()["offloaded"] == 0  # every activation is 8 KiB < 8 KiB + 1
    store2 = make_store()
    with offload_activations([model], store=store2, layers=[0], offload_weights=True,
                             min_offload_bytes=0) as off2:
        y = model(x).sum()
        assert any(k for k in store2.keys())
        y.backward()
    assert off2.stats()["offloaded"] > 0
    _assert_clean(store2, off2)


# ---------------------------------------------------------------------------------- lifetime


class _WatchBlock(nn.Module):
    """Saves an intermediate (``x * 2``, kept by sin) and keeps a weakref to its storage."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.refs: list = []

    def forward(self, x):
        tmp = self.lin(x) * 2
        self.refs.append(weakref.ref(tmp.untyped_storage()))
        return torch.sin(tmp)


def test_offloaded_device_memory_is_released_in_forward(make_store):
    blocks = nn.Sequential(_WatchBlock(), _WatchBlock(), _WatchBlock())
    x = torch.randn(16, 64, requires_grad=True)
    store = make_store()
    with offload_activations(list(blocks), store=store, layers=[0, 1]) as off:
        loss = blocks(x).sum()
        alive = [b.refs[-1]() is not None for b in blocks]
        assert alive == [False, False, True]  # offloaded: only the store's copy is left
        assert off.live_keys > 0
        loss.backward()
    _assert_clean(store, off)


def test_reloaded_copies_are_freed_during_backward(make_store):
    model = TinyGPT(n_layers=6)
    store = make_store()
    live = []
    for i, block in enumerate(model.blocks):
        block.register_full_backward_pre_hook(
            lambda m, g, i=i: live.append((i, len(store))))
    idx, targets = make_batch(2)
    with offload_activations(model.blocks, store=store, prefetch_depth=1) as off:
        _, loss = model(idx, targets)
        total = len(store)
        loss.backward()
    counts = [n for _, n in live]
    assert counts == sorted(counts, reverse=True) and counts[-1] < total / 3, (total, live)
    _assert_clean(store, off)


def test_retain_graph_keeps_data_for_a_second_backward(make_store):
    def steps(model):
        idx, targets = make_batch(4)
        _, loss = model(idx, targets)
        loss.backward(retain_graph=True)
        loss.backward()

    ref, _ = _run(TinyGPT, steps)
    store = make_store()
    model, off = _run(TinyGPT, steps, offload=lambda m: offload_activations(m.blocks, store=store))
    _assert_equal_grads(_grads(ref), _grads(model))
    _assert_clean(store, off)


def test_graph_dropped_without_backward_deletes_its_keys(make_store):
    model = TinyGPT()
    store = make_store()
    with offload_activations(model.blocks, store=store) as off:
        _, loss = model(*make_batch(5))
        assert len(store) > 0
        del loss, _
    _assert_clean(store, off)


def test_backward_after_the_with_block_and_one_private_store_for_every_step(tmp_path):
    ref, _ = _run(TinyGPT, _train_step())
    torch.manual_seed(0)
    model = TinyGPT()
    off = offload_activations(model.blocks)
    with off:
        _, loss = model(*make_batch(1))
    store = off.store
    assert len(store) > 0
    loss.backward()
    assert off.live_keys == 0 and len(store) == 0
    _assert_equal_grads(_grads(ref), _grads(model))
    for step in range(3):  # entered again: the same private store (pinned blocks reused)
        with off:
            model(*make_batch(step))[1].backward()
    assert off.store is store and not store.closed
    off.close()
    assert store.closed


def test_a_dropped_offloader_closes_its_private_store():
    model = TinyGPT()
    off = offload_activations(model.blocks)
    with off:
        model(*make_batch(1))[1].backward()
    store = off.store
    del off
    gc.collect()
    assert store.closed


# ---------------------------------------------------------------------------------- loops


@pytest.mark.parametrize("checkpointed", [False, True])
def test_two_forwards_then_one_backward(make_store, checkpointed):
    make = lambda: TinyGPT(checkpoint_blocks=checkpointed)  # noqa: E731

    def steps(model):
        _, l1 = model(*make_batch(6))
        _, l2 = model(*make_batch(7))
        (l1 + l2).backward()

    ref, _ = _run(make, steps)
    store = make_store()
    model, off = _run(make, steps, offload=lambda m: offload_activations(
        m.blocks, store=store, prefetch_depth=2))
    _assert_equal_grads(_grads(ref), _grads(model))
    _assert_clean(store, off)


def test_accumulation_with_eval_forward_in_between(make_store):
    def steps(model):
        for seed in (8, 9):
            _, loss = model(*make_batch(seed))
            with torch.no_grad():
                model(*make_batch(seed + 10))
            loss.backward()

    ref, _ = _run(TinyGPT, steps)
    store = make_store()
    model, off = _run(TinyGPT, steps, offload=lambda m: offload_activations(m.blocks, store=store))
    _assert_equal_grads(_grads(ref), _grads(model))
    _assert_clean(store, off)


def test_eval_forward_leaves_the_store_empty(make_store):
    model = TinyGPT()
    store = make_store()
    with offload_activations(model.blocks, store=store) as off:
        with torch.no_grad():
            model(*make_batch(1))
        assert len(store) == 0 and off.stats()["packed"] == 0
        with torch.inference_mode():
            model(*make_batch(1))
        assert len(store) == 0


# ---------------------------------------------------------------------------------- budgets


def test_small_cpu_budget_spills_to_nvme_and_holds_budgets(make_store):
    ref, _ = _run(TinyGPT, _train_step())
    store = make_store(cpu_bytes=128 << 10, gpu_bytes=256 << 10, pool_slab_bytes=64 << 10)
    model, off = _run(TinyGPT, _train_step(), offload=lambda m: offload_activations(
        m.blocks, store=store, tier="cpu"))
    _assert_equal_grads(_grads(ref), _grads(model))
    moved = store.stats()["moved_bytes"]
    assert moved.get("cpu->nvme", 0) > 0  # the cpu tier overflowed into the nvme tier
    _assert_clean(store, off)


def test_full_store_keeps_tensors_on_the_device_with_a_warning(make_store):
    ref, _ = _run(TinyGPT, _train_step())
    store = make_store(cpu_bytes=16 << 10, nvme_bytes=0, pool_slab_bytes=16 << 10)
    with pytest.warns(RuntimeWarning, match="store is full"):
        model, off = _run(TinyGPT, _train_step(), offload=lambda m: offload_activations(
            m.blocks, store=store))
    _assert_equal_grads(_grads(ref), _grads(model))
    assert off.stats()["store_full"] > 0
    _assert_clean(store, off)


def test_tiny_gpu_tier_reloads_without_it(make_store):
    """Reloads that do not fit the store's gpu tier are copied out of the cpu tier directly."""
    ref, _ = _run(TinyGPT, _train_step())
    store = make_store(gpu_bytes=4096)
    model, off = _run(TinyGPT, _train_step(), offload=lambda m: offload_activations(
        m.blocks, store=store))
    _assert_equal_grads(_grads(ref), _grads(model))
    assert off.stats()["gpu_full"] > 0
    _assert_clean(store, off)


# ---------------------------------------------------------------------------------- races


def _slow_store(store: TierStore, seed: int, max_delay_s: float = 0.002) -> ThreadPoolExecutor:
    """Delay every copy and every spill read/write by a random time, reordering completions."""
    rng = random.Random(seed)
    lock = threading.Lock()

    def delay():
        with lock:
            return rng.uniform(0, max_delay_s)

    copier = store._copier
    h2d, d2h = copier.h2d, copier.d2h

    def slow_h2d(dst, src):
        time.sleep(delay())
        return h2d(dst, src)

    def slow_d2h(dst, src):
        time.sleep(delay())
        return d2h(dst, src)

    copier.h2d, copier.d2h = slow_h2d, slow_d2h
    pool = ThreadPoolExecutor(4)
    if store._spill is not None:
        backend = store._spill.backend
        pwrite, pread = backend.pwrite, backend.pread

        def slow(fn):
            def call(handle, buf, offset):
                out: Future = Future()

                def run():
                    time.sleep(delay())
                    inner = fn(handle, buf, offset)
                    try:
                        out.set_result(inner.result())
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        out.set_exception(exc)
                pool.submit(run)
                return out
            return call

        backend.pwrite, backend.pread = slow(pwrite), slow(pread)
    return pool


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("seed", [0, 1])
def test_race_slow_copies_and_spills(make_store, tier, seed):
    make = lambda: TinyGPT(n_layers=5)  # noqa: E731

    def steps(model):
        _, l1 = model(*make_batch(11))
        _, l2 = model(*make_batch(12))
        (l1 + l2).backward()
        model(*make_batch(13))[1].backward()

    ref, _ = _run(make, steps)
    store = make_store(cpu_bytes=256 << 10, pool_slab_bytes=64 << 10)
    pool = _slow_store(store, seed)
    try:
        model, off = _run(make, steps, offload=lambda m: offload_activations(
            m.blocks, store=store, tier=tier, prefetch_depth=2))
    finally:
        pool.shutdown(wait=True)
    _assert_equal_grads(_grads(ref), _grads(model))
    _assert_clean(store, off)


# ---------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(num_layers=4), ValueError, r"num_layers=4 is outside \[0, 4\).*4 blocks.*num_layers < 4"),
    (dict(num_layers=-1), ValueError, r"num_layers=-1 is outside \[0, 4\)"),
    (dict(num_layers=1.5), TypeError, r"num_layers must be an int, got 1.5"),
    (dict(layers=[0, 7]), ValueError, r"layers contains 7, outside \[0, 4\).*indices 0..3"),
    (dict(layers=["a"]), TypeError, r"layers must hold block indices"),
    (dict(num_layers=2, layers=[1]), TypeError, r"num_layers=2 or layers=\[1\], not both"),
    (dict(prefetch_depth=0), ValueError, r"prefetch_depth=0 must be an int >= 1"),
    (dict(prefetch_depth=2.0), TypeError, r"prefetch_depth must be an int"),
    (dict(tier="gpu"), ValueError, r"tier='gpu' is not one of 'cpu', 'nvme'; 'cpu' is pinned"),
    (dict(tier="ssd"), ValueError, r"tier='ssd' is not one of"),
    (dict(tier="nvme"), ValueError, r"tier='nvme' needs a store with an nvme budget"),
    (dict(min_offload_bytes=-1), ValueError, r"min_offload_bytes=-1 must be an int >= 0 \(bytes\)"),
    (dict(double_buffering=True, prefetch_depth=2), ValueError,
     r"double_buffering=True.*prefetch_depth=2 cannot work; pass prefetch_depth=1"),
    (dict(store="x"), TypeError, r"store must be a tiermem.TierStore, got str"),
])
def test_validation_errors_name_the_value_and_the_fix(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        offload_activations(TinyGPT().blocks, **kwargs)


def test_validation_of_blocks_and_nvme_store(make_store):
    with pytest.raises(TypeError, match="blocks must be a list or nn.ModuleList"):
        offload_activations(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="blocks is empty"):
        offload_activations([])
    with pytest.raises(TypeError, match=r"blocks\[1\] is a int"):
        offload_activations([nn.Linear(2, 2), 3])
    with pytest.raises(ValueError, match=r"no nvme budget \(StoreConfig.nvme_bytes=0\)"):
        offload_activations(TinyGPT().blocks, store=make_store(nvme_bytes=0), tier="nvme")


def test_nested_use_is_rejected_and_state_recovers(make_store):
    model = TinyGPT()
    store = make_store()
    with offload_activations(model.blocks, store=store):
        inner = offload_activations(model.blocks, store=store)
        with pytest.raises(RuntimeError, match="another offload context is active; nested use"):
            inner.__enter__()
    with offload_activations(model.blocks, store=store) as off:  # usable again after exit
        model(*make_batch(1))[1].backward()
    _assert_clean(store, off)


# ---------------------------------------------------------------------------------- policy


def test_policy_layers_and_prefetch_targets():
    assert resolve_layers(4, None, None) == {0, 1, 2}
    assert resolve_layers(4, 0, None) == frozenset()
    assert resolve_layers(1, None, None) == frozenset()
    assert resolve_layers(4, None, [3, 1]) == {1, 3}
    pol = LayerPolicy(4, frozenset({0, 1, 2}), 1024, False, 2)
    order = [(1, 0), (1, 1), (1, 2)]
    assert pol.prefetch_targets(order, None) == [(1, 2), (1, 1)]
    assert pol.prefetch_targets(order, (1, 2)) == [(1, 1), (1, 0)]
    assert pol.prefetch_targets(order, (1, 0)) == []
    assert pol.offloads_tensor(1024, False, True, True)
    assert not pol.offloads_tensor(1023, False, True, True)
    assert not pol.offloads_tensor(4096, True, True, True)
    assert not pol.offloads_tensor(4096, False, False, True)
    assert not pol.offloads_layer(None) and not pol.offloads_layer(3) and pol.offloads_layer(0)


# ---------------------------------------------------------------------------------- CUDA


def _cuda_store(tmp_path, **kw):
    kw.setdefault("gpu_bytes", "16GiB")
    kw.setdefault("cpu_bytes", "8GiB")
    kw.setdefault("nvme_bytes", "8GiB")
    kw.setdefault("pool_slab_bytes", "256MiB")
    kw.setdefault("io_backend", "posix")
    return TierStore(StoreConfig(nvme_dir=str(tmp_path), device="cuda", **kw))


def _assert_within_noise(ref, ref2, got, multiple: float = 4.0, ulps: float = 0.0) -> None:
    """Each gradient within ``multiple`` x the reference's run-to-run difference (Note
    [training parity] in tests/test_cuda_training_parity.py), or within ``ulps`` rounding steps
    at the gradient's largest magnitude (``finfo.eps`` x its max |value|): exact where both are
    zero. The floor is for torch's default kernels, whose noise is discrete: two runs can agree
    exactly while a third lands one rounding step away (H200: 1.5e-8 in a bf16 gradient whose
    two references agreed); a stale or wrong tensor moves a gradient by O(its magnitude)."""
    for i, (a, b, g) in enumerate(zip(ref, ref2, got)):
        noise, diff = (a - b).abs().max(), (g - a).abs().max()
        floor = ulps * torch.finfo(a.dtype).eps * a.abs().max()
        assert diff <= torch.maximum(multiple * noise, floor), (
            f"gradient {i}: max diff {diff} > {multiple} x {noise} and > {ulps} ulp ({floor})")


def _sleepy_streams(store: TierStore, off: ActivationOffloader, cycles: int = 2_000_000) -> None:
    """Queue a long GPU sleep on the copy streams before every copy (widens missing-wait races)."""
    copier = store._copier
    h2d, d2h = copier.h2d, copier.d2h

    def slow_h2d(dst, src):
        with torch.cuda.stream(copier.h2d_stream):
            torch.cuda._sleep(cycles)
        return h2d(dst, src)

    def slow_d2h(dst, src):
        copier.d2h_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(copier.d2h_stream):
            torch.cuda._sleep(cycles)
        return d2h(dst, src)

    copier.h2d, copier.d2h = slow_h2d, slow_d2h
    if off._buffers is not None:
        load = off._buffers.load

        def slow_load(records, st):
            off._buffers.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(off._buffers.stream):
                torch.cuda._sleep(cycles)
            return load(records, st)

        off._buffers.load = slow_load


def _no_device_sync(monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("torch.cuda.synchronize() called during offload")
    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("setup", ["cpu", "nvme", "checkpoint", "double_buffering", "all_layers"])
def test_cuda_gradients_equal_with_sleepy_streams(tmp_path, monkeypatch, dtype, setup):
    make = lambda: TinyGPT(vocab=512, d_model=256, n_heads=8, n_layers=6, seq_len=256,  # noqa: E731
                           checkpoint_blocks=setup == "checkpoint").to(dtype)

    def steps(model):  # torch's default SDPA backend, as users run it
        for seeds in ((21, 22), (23,)):
            losses = [model(*make_batch(s, batch=8, seq_len=256, vocab=512,
                                        device="cuda"))[1] for s in seeds]
            sum(losses).backward()

    ref, _ = _run(make, steps, device="cuda")
    ref2, _ = _run(make, steps, device="cuda")  # the default kernels' run-to-run noise
    store = _cuda_store(tmp_path)
    kw = dict(tier="nvme" if setup == "nvme" else "cpu",
              double_buffering=setup == "double_buffering",
              layers=list(range(6)) if setup == "all_layers" else range(5))

    def offload(m):
        off = offload_activations(m.blocks, store=store, **kw)
        off.__enter__()
        off.__exit__(None, None, None)  # builds the double buffer; hooks are entered again below
        _sleepy_streams(store, off)
        return off

    _no_device_sync(monkeypatch)
    model, off = _run(make, steps, device="cuda", offload=offload)
    monkeypatch.undo()
    _assert_within_noise(_grads(ref), _grads(ref2), _grads(model), ulps=1)
    assert off.stats()["offloaded"] > 0
    torch.cuda.current_stream().synchronize()  # test only: let reaped moves settle
    _assert_clean(store, off)
    store.close()


def _peak_bytes(model, batch, offload=None) -> int:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    idx, targets = batch
    if offload is None:
        model(idx, targets)[1].backward()
    else:
        with offload:
            model(idx, targets)[1].backward()
    model.zero_grad(set_to_none=True)
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.cuda
def test_cuda_peak_memory_falls_as_num_layers_grows(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(vocab=1024, d_model=1024, n_heads=16, n_layers=8, seq_len=1024).cuda()
    model = model.to(torch.bfloat16)
    batch = make_batch(0, batch=8, seq_len=1024, vocab=1024, device="cuda")
    store = _cuda_store(tmp_path, gpu_bytes="40GiB", cpu_bytes="48GiB", nvme_bytes=0)
    _peak_bytes(model, batch)  # warm up kernels and the allocator
    peaks = {"none": _peak_bytes(model, batch)}
    for n in (0, 2, 4, 6, 7):
        peaks[n] = _peak_bytes(model, batch, offload_activations(model.blocks, store=store,
                                                                 num_layers=n))
        assert len(store) == 0
    print("peak GiB by num_layers:", {k: round(v / 2**30, 3) for k, v in peaks.items()})
    slack = 0.03 * peaks["none"]
    values = [peaks[n] for n in (0, 2, 4, 6, 7)]
    assert all(b <= a + slack for a, b in zip(values, values[1:])), peaks
    assert peaks[7] < 0.6 * peaks[0], peaks
    store.close()


# ---------------------------------------------------------------------------------- layers="auto"


def _three_steps(model):
    for seed in (1, 2, 3):
        idx, targets = make_batch(seed)
        model(idx, targets)[1].backward()


@pytest.mark.parametrize("bandwidth, max_kept, expected", [
    (1e15, None, [0, 1, 2]),   # copies are free: all but the last (needed first in backward)
    (1.0, None, []),           # copies never hide: nothing
    (1.0, 0, [0, 1, 2, 3]),    # nothing may stay on the device: everything, stall or not
])
def test_auto_layers_follow_measured_compute_and_transfer(make_store, monkeypatch, bandwidth,
                                                          max_kept, expected):
    import tiermem.offload.calibration as cal
    monkeypatch.setattr(cal, "copy_bandwidths", lambda device, nbytes: (bandwidth, bandwidth))
    ref, _ = _run(TinyGPT, _three_steps)
    store = make_store(gpu_bytes=8 << 20, cpu_bytes=8 << 20)
    puts = []

    def steps(model):
        for seed in (1, 2, 3):
            before = off.counters["put_bytes"]
            idx, targets = make_batch(seed)
            model(idx, targets)[1].backward()
            puts.append(off.counters["put_bytes"] - before)

    torch.manual_seed(0)
    model = TinyGPT()
    off = offload_activations(model.blocks, store=store, max_kept_bytes=max_kept)
    with off:
        assert off.policy.layers == frozenset({0, 1, 2}) and off.plan is None  # calibrating
        steps(model)
    _assert_equal_grads(_grads(ref), _grads(model))  # bit-identical whatever is offloaded
    plan = off.plan
    assert plan["layers"] == expected and off.policy.layers == frozenset(expected)
    assert len(plan["fwd_ms"]) == 4 and all(ms >= 0 for ms in plan["fwd_ms"])
    assert all(n > 0 for n in plan["nbytes"]) and plan["d2h_gbps"] == bandwidth / 1e9
    assert plan["kept_bytes"] == sum(n for i, n in enumerate(plan["nbytes"]) if i not in expected)
    assert puts[0] == puts[1] > 0  # the first two forwards offload all but the last block
    per_block = plan["nbytes"][0]
    assert puts[2] == pytest.approx(len(expected) * per_block, rel=0.01)
    _assert_clean(store, off)


def test_auto_layers_on_nvme_count_the_disk(make_store, monkeypatch):
    import tiermem.offload.calibration as cal
    monkeypatch.setattr(cal, "copy_bandwidths", lambda device, nbytes: (1e15, 1e15))
    disk = []
    monkeypatch.setattr(cal, "disk_bandwidths", lambda d: disk.append(d) or (1.0, 2.0))
    store = make_store(gpu_bytes=8 << 20, cpu_bytes=1 << 20, nvme_bytes=16 << 20)
    model, off = _run(TinyGPT, _three_steps, offload=lambda m: offload_activations(
        m.blocks, store=store, tier="nvme"))
    assert disk == [store.config.nvme_dir]
    assert (off.plan["d2h_gbps"], off.plan["h2d_gbps"]) == (1e-9, 2e-9)
    assert off.plan["layers"] == []  # a disk at 1-2 bytes/s hides nothing


def test_timed_forward_puts_each_block_after_its_end_mark(make_store, monkeypatch):
    """Note [timed forward]: in the timed forward no put runs between a block's start and end
    marks (the host work of offloading is not timed as the block's compute); each offloaded
    block's puts follow its end mark, their host time is in the plan, and training is exact."""
    import tiermem.offload.calibration as cal
    monkeypatch.setattr(cal, "copy_bandwidths", lambda device, nbytes: (1e15, 1e15))
    log = []
    for name in ("enter", "exit"):
        real = getattr(cal._Calibration, name)
        monkeypatch.setattr(cal._Calibration, name, lambda self, i, d, real=real, name=name: (
            log.append((name, i)), real(self, i, d))[1])
    store = make_store(gpu_bytes=8 << 20, cpu_bytes=8 << 20)
    real_put = store.put
    monkeypatch.setattr(store, "put", lambda *a, **k: (log.append(("put", None)),
                                                       real_put(*a, **k))[1])
    ref, _ = _run(TinyGPT, _three_steps)
    model, off = _run(TinyGPT, _three_steps,
                      offload=lambda m: offload_activations(m.blocks, store=store))
    _assert_equal_grads(_grads(ref), _grads(model))
    timed = log[log.index(("enter", 0)):log.index(("exit", 3)) + 1]
    inside, puts_after = None, {}
    for what, i in timed:
        if what == "enter":
            inside = i
        elif what == "exit":
            inside, last = None, i
        else:
            assert inside is None, f"a put inside block {inside}'s timed span"
            puts_after[last] = puts_after.get(last, 0) + 1
    assert sorted(puts_after) == [0, 1, 2]  # every block but the last is offloaded
    assert len(off.plan["offload_host_ms"]) == 4 and off.plan["offload_host_ms"][3] == 0.0
    assert len(off.plan["host_ms"]) == 4 and all(ms > 0 for ms in off.plan["host_ms"])
    assert all(ms > 0 for ms in off.plan["offload_host_ms"][:3])
    _assert_clean(store, off)


def test_explicit_layers_make_no_plan(make_store):
    store = make_store(gpu_bytes=8 << 20, cpu_bytes=8 << 20)
    model, off = _run(TinyGPT, _three_steps, offload=lambda m: offload_activations(
        m.blocks, store=store, num_layers=2))
    assert off.plan is None and off.policy.layers == frozenset({0, 1})


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(layers="some"), ValueError, r"layers='some' is unknown; pass 'auto'"),
    (dict(layers="auto", num_layers=2), TypeError, r"num_layers=2 or layers='auto', not both"),
    (dict(num_layers=2, max_kept_bytes=1), ValueError, r"max_kept_bytes bounds the automatic"),
    (dict(max_kept_bytes=-5), ValueError, r"max_kept_bytes=-5 must be an int >= 0"),
])
def test_auto_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        offload_activations(TinyGPT().blocks, **kwargs)


@pytest.mark.cuda
def test_cuda_auto_layers_time_blocks_with_events_and_keep_gradients(tmp_path):
    make = lambda: TinyGPT(vocab=1024, d_model=1024, n_heads=16, n_layers=8,  # noqa: E731
                           seq_len=1024).to(torch.bfloat16)
    batches = [make_batch(s, batch=8, seq_len=1024, vocab=1024, device="cuda") for s in range(4)]

    def steps(model):  # torch's default SDPA backend
        for idx, targets in batches:
            model(idx, targets)[1].backward()

    ref, _ = _run(make, steps, device="cuda")
    ref2, _ = _run(make, steps, device="cuda")  # the default kernels' run-to-run noise
    store = _cuda_store(tmp_path, gpu_bytes="40GiB", cpu_bytes="48GiB", nvme_bytes=0)
    model, off = _run(make, steps, device="cuda",
                      offload=lambda m: offload_activations(m.blocks, store=store))
    _assert_within_noise(_grads(ref), _grads(ref2), _grads(model), ulps=1)
    plan = off.plan
    print("auto plan:", {k: v for k, v in plan.items()})
    assert all(ms > 0 for ms in plan["fwd_ms"]) and all(n > 0 for n in plan["nbytes"])
    assert plan["d2h_gbps"] > 1 and plan["h2d_gbps"] > 1  # pinned copies, not pageable
    assert 7 not in plan["layers"]  # the last block's reload cannot hide
    assert plan["kept_bytes"] <= plan["max_kept_bytes"]
    torch.cuda.current_stream().synchronize()  # test only: let reaped moves settle
    _assert_clean(store, off)
    store.close()
