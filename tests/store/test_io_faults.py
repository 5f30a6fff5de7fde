"""I/O faults of the NVMe tier seen by its users, injected at the lowest call the store makes
(``os.preadv`` / ``os.pwritev`` of tiermem/store/io/posix.py) or on the spill file itself.

The store's own fault handling (ENOSPC, EIO, short reads and writes, truncation, bit flips) is
tested in tests/reliability/test_store_faults.py and tests/store/test_nvme.py; the activation
offload's in tests/offload/test_spill_failure.py, the streamed weights' NVMe home in
tests/stream/test_stream_nvme_home.py. Here: HybridAdam's state on NVMe (``state_tier="nvme"``
and ``"split"``) when a step's chunk read (the worker's ``get``, the read-ahead's ``prefetch``)
or write-back fails, or the spill file is cut short: the step raises naming the key and the
file, the optimizer then refuses to step or save a state mixed of two steps (Note [failed
steps] in tiermem/optim/step_tail.py), and a checkpoint taken before the failure resumes bit
for bit like a run that never failed (also over a truncated file, and on CUDA: not run here).
Then the spill file cut and grown again by a later write (Note [cut spill file]), a spill
filesystem turning read-only, activation offload with the file cut between forward and
backward, and a streamed NVMe home whose placement writes hit ENOSPC. A file tiermem did not
make beside the spill directory survives all of it and ``close()``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import warnings

import pytest
import torch

import tiermem.store.io.posix as posix_mod
from models import TinyGPT
from tiermem import StoreConfig, TierStore
from tiermem.checkpoint import load_checkpoint, save_checkpoint
from tiermem.optim import HybridAdam
from tiermem.store.spill_errors import SpillError

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS, GOOD, BAD = 6, 2, 3  # checkpoint after step GOOD; the fault hits step BAD
FOREIGN = "not-tiermems.txt"


def _batches():
    gen = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 64, (2, 8), generator=gen),
             torch.randint(0, 64, (2, 8), generator=gen)) for _ in range(STEPS)]


def _optimizer(model, tier, nvme_dir):
    kw = dict(lr=1e-2, weight_decay=0.1, offload_fraction=0.75, chunk_numel=1024,
              state_tier=tier)
    if tier == "split":  # half the chunks in RAM, half on NVMe
        store = TierStore(StoreConfig(gpu_bytes=0, cpu_bytes=512 << 10, nvme_bytes=8 << 20,
                                      nvme_dir=nvme_dir, pool_slab_bytes=64 << 10,
                                      io_backend="posix", io_threads=2, o_direct=False))
        return HybridAdam(model.parameters(), store=store, **kw), store
    return HybridAdam(model.parameters(), nvme_dir=nvme_dir, **kw), None


def _step(model, opt, batch):
    model(*batch)[1].backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def _fresh(tier, nvme_dir):
    """A run's model (seed 0), optimizer, its store (or None) and the batches."""
    torch.manual_seed(0)
    model = TinyGPT()
    opt, store = _optimizer(model, tier, str(nvme_dir))
    return model, opt, store, _batches()


def _reference(tmp_path, tier):
    model, opt, store, _ = _fresh(tier, tmp_path)
    assert opt.memory_bytes()["nvme"] > 0, "no state on NVMe: the test tests nothing"
    out = [_step(model, opt, b) for b in _batches()]
    opt.close()
    if store is not None:
        store.close()
    return out


def _fault(kind, opt, monkeypatch):
    """Start fault ``kind``; return the function that clears it (the disk recovers)."""
    if kind == "truncated":  # someone cut the spill file: the state on it is gone
        os.truncate(opt.store._spill.path, 0)
        return lambda: None
    name, err = ("preadv", errno.EIO) if kind == "read EIO" else ("pwritev", errno.ENOSPC)

    def failing(*args, **kwargs):
        raise OSError(err, f"{os.strerror(err)} (injected)")

    monkeypatch.setattr(posix_mod.os, name, failing)
    return monkeypatch.undo


@pytest.mark.parametrize("tier", ["nvme", "split"])
@pytest.mark.parametrize("kind", ["read EIO", "write ENOSPC", "truncated"])
def test_a_failed_state_read_or_write_refuses_the_mixed_state_and_resumes_exactly(
        tmp_path, monkeypatch, tier, kind):
    """The step whose chunk I/O failed raises, naming the chunk's key and the spill file; the
    next step() and state_dict() refuse (some chunks of the failed step were updated, the rest
    and the step counts not: continuing silently diverged from the run without the fault);
    loading the checkpoint taken before it resumes bit for bit like that run. The old code
    stepped on from the mixed state (red: DID NOT RAISE)."""
    (tmp_path / "ref").mkdir()
    ref = _reference(tmp_path / "ref", tier)
    nvme_dir = tmp_path / "run"
    nvme_dir.mkdir()
    (nvme_dir / FOREIGN).write_text("keep me")
    model, opt, store, batches = _fresh(tier, nvme_dir)
    spill = None
    try:
        for step in range(GOOD):
            _step(model, opt, batches[step])
        save_checkpoint(tmp_path / "good.pt", model=model, optimizer=opt)
        spill = opt.store._spill.path
        clear = _fault(kind, opt, monkeypatch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "spilling ... failed": in RAM
            with pytest.raises(RuntimeError, match="the CPU step failed") as info:
                _step(model, opt, batches[BAD - 1])
        clear()
        cause = info.value.__cause__
        assert spill in str(info.value), str(info.value)
        assert "hybrid_adam" in str(info.value), "the chunk's key is not named"
        assert getattr(cause, "key", None) is not None or "hybrid_adam" in str(cause)
        opt.zero_grad(set_to_none=True)
        model(*batches[BAD - 1])[1].backward()
        with pytest.raises(RuntimeError, match=r"step\(\) refused.*Note \[failed steps\]"):
            opt.step()
        opt.zero_grad(set_to_none=True)
        with pytest.raises(RuntimeError, match=r"state_dict\(\) refused"):
            opt.state_dict()
        with pytest.raises(RuntimeError, match="refused"):
            save_checkpoint(tmp_path / "bad.pt", model=model, optimizer=opt)
        assert not (tmp_path / "bad.pt").exists()
        load_checkpoint(tmp_path / "good.pt", model=model, optimizer=opt)
        for step in range(GOOD, STEPS):
            got = _step(model, opt, batches[step])
            bad = [i for i, (a, b) in enumerate(zip(ref[step], got)) if not torch.equal(a, b)]
            assert not bad, f"step {step + 1}: params {bad[:4]} differ from the run without it"
    finally:
        opt.close()
        if store is not None:
            store.close()
    assert sorted(os.listdir(nvme_dir)) == [FOREIGN], os.listdir(nvme_dir)
    assert (nvme_dir / FOREIGN).read_text() == "keep me"


def test_the_refusal_is_needed_continuing_diverges(tmp_path, monkeypatch):
    """The twin that must fail: stepping on after the failed step (the refusal bypassed, as the
    old code did) gives other parameters than the run without the fault."""
    (tmp_path / "ref").mkdir()
    ref = _reference(tmp_path / "ref", "nvme")
    model, opt, _, batches = _fresh("nvme", tmp_path)
    try:
        for step in range(GOOD):
            _step(model, opt, batches[step])
        clear = _fault("read EIO", opt, monkeypatch)
        with pytest.raises(RuntimeError, match="the CPU step failed"):
            _step(model, opt, batches[BAD - 1])
        clear()
        opt._failed = None  # what the old code did: the next step went ahead
        opt.zero_grad(set_to_none=True)
        got = [_step(model, opt, batches[step]) for step in range(BAD - 1, STEPS)]
    finally:
        opt.close()
    assert any(not torch.equal(a, b) for a, b in zip(ref[-1], got[-1]))


def test_a_resume_over_a_truncated_spill_file_loads_and_trains_exactly(tmp_path):
    """The spill file cut short between steps (no step failed): the old load read each chunk's
    NVMe copy before overwriting all of it, so load_checkpoint raised SpillCorruption and the
    optimizer could never be restored in place. A load now replaces an unreadable chunk and
    the run goes on bit for bit like the one without the damage."""
    (tmp_path / "ref").mkdir()
    ref = _reference(tmp_path / "ref", "nvme")
    model, opt, _, batches = _fresh("nvme", tmp_path)
    try:
        for step in range(GOOD):
            _step(model, opt, batches[step])
        save_checkpoint(tmp_path / "good.pt", model=model, optimizer=opt)
        os.truncate(opt.store._spill.path, 0)
        load_checkpoint(tmp_path / "good.pt", model=model, optimizer=opt)
        for step in range(GOOD, STEPS):
            got = _step(model, opt, batches[step])
            assert all(torch.equal(a, b) for a, b in zip(ref[step], got)), step
    finally:
        opt.close()


def test_a_load_that_fails_partway_refuses_the_mixed_state(tmp_path, monkeypatch):
    """A load_state_dict whose write-back fails after some chunks were loaded leaves a state
    of two checkpoints: step() refuses it (the old code stepped from it), and a load that
    succeeds clears the refusal."""
    model, opt, _, batches = _fresh("nvme", tmp_path)
    try:
        _step(model, opt, batches[0])
        state = opt.state_dict()
        real, calls = opt.store.evict, []

        def evict(key, tier="cpu"):
            calls.append(key)
            if len(calls) == 2:
                raise OSError(errno.EIO, "Input/output error (injected)")
            return real(key, tier)

        monkeypatch.setattr(opt.store, "evict", evict)
        with pytest.raises(OSError, match="injected"):
            opt.load_state_dict(state)
        monkeypatch.undo()
        model(*batches[1])[1].backward()
        with pytest.raises(RuntimeError, match=r"step\(\) refused.*injected"):
            opt.step()
        opt.zero_grad(set_to_none=True)
        opt.load_state_dict(state)
        _step(model, opt, batches[1])
    finally:
        opt.close()


def test_a_failure_of_a_forward_synced_step_surfaces_at_the_next_forward(tmp_path,
                                                                          monkeypatch):
    """param_sync="forward": step() returns before the CPU side is done; its read failure is
    raised by the next forward (naming the key and the file), and the step after refuses."""
    torch.manual_seed(0)
    model = TinyGPT()
    opt = HybridAdam(model.parameters(), lr=1e-2, offload_fraction=0.75, chunk_numel=1024,
                     state_tier="nvme", nvme_dir=str(tmp_path), param_sync="forward")
    batches = _batches()
    try:
        for step in range(GOOD):
            _step(model, opt, batches[step])
        spill = opt.store._spill.path
        opt.synchronize()  # the last good step's CPU side is done before the disk fails
        clear = _fault("read EIO", opt, monkeypatch)
        model(*batches[GOOD])[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with pytest.raises(RuntimeError, match="the CPU step failed") as info:
            model(*batches[GOOD + 1])
            opt.synchronize()
        clear()
        assert spill in str(info.value) and "hybrid_adam" in str(info.value)
        model(*batches[GOOD + 1])[1].backward()
        with pytest.raises(RuntimeError, match=r"step\(\) refused"):
            opt.step()
    finally:
        opt.zero_grad(set_to_none=True)
        opt.close()


@pytest.mark.parametrize("checksum", [False, True])
def test_a_spill_file_cut_then_regrown_by_a_later_write_is_never_read_as_data(tmp_path,
                                                                              checksum):
    """Note [cut spill file]: someone truncates the spill file, then the store's next write
    grows it past the cut again (a hole reading as zeros). Without checksums the old code
    returned the zeros as the key's bytes; now every key the cut reached raises
    SpillCorruption ("truncated") naming it and the file, keys written after the cut read
    back exactly, and the store (and a foreign file beside it) survives."""
    (tmp_path / FOREIGN).write_text("keep me")
    store = TierStore(StoreConfig(gpu_bytes=0, cpu_bytes=64 << 10, nvme_bytes=1 << 20,
                                  nvme_dir=str(tmp_path), pool_slab_bytes=64 << 10,
                                  io_backend="posix", io_threads=2, o_direct=False,
                                  checksum=checksum, io_chunk_bytes=16 << 10))
    gen = torch.Generator().manual_seed(0)
    values = {k: torch.randn(3000, generator=gen) for k in ("a", "b", "c")}
    try:
        for key in ("a", "b"):
            store.put(key, values[key], "nvme")
        store.synchronize()
        spill = store._spill.path
        os.truncate(spill, 4096)  # "a" keeps its first page, "b" is gone
        store.put("c", values["c"], "nvme")  # grows the file past the cut again
        store.synchronize()
        assert os.path.getsize(spill) > 4096, "the file did not grow back: tests nothing"
        for key in ("a", "b"):
            with pytest.raises(SpillError, match="truncated") as info:
                store.get(key, "cpu")
            assert info.value.key == key and info.value.path == spill
        assert torch.equal(store.get("c", "cpu"), values["c"])
        store.put("a", values["a"], "nvme")  # a key written again after the cut is readable
        store.synchronize()
        assert torch.equal(store.get("a", "cpu"), values["a"])
    finally:
        store.close()
    assert sorted(os.listdir(tmp_path)) == [FOREIGN]


def _cuda_resume(tmp_path, ckpt, lane: float, fault: bool, bypass: bool = False) -> list:
    """From checkpoint ``ckpt``: (fault) a step whose NVMe reads fail with EIO, then (unless
    ``bypass``) the refusal and the load of ``ckpt`` again; then 8 steps on CUDA. Returns the
    loss of every step and the params after the last."""
    torch.manual_seed(1)
    model = TinyGPT().cuda()
    opt = HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.1, offload_fraction=0.75,
                     chunk_numel=1024, state_tier="nvme", nvme_dir=str(tmp_path),
                     param_sync="step", gpu_step_fraction=lane)
    load_checkpoint(ckpt, model=model, optimizer=opt)
    batches = [(x.cuda(), y.cuda()) for x, y in _batches()] * 2
    losses = []
    try:
        if fault:
            with pytest.MonkeyPatch.context() as mp:
                _fault("read EIO", opt, mp)
                model(*batches[0])[1].backward()
                with pytest.raises(RuntimeError, match="the CPU step failed") as info:
                    opt.step()
            assert opt.store._spill.path in str(info.value) and "hybrid_adam" in str(info.value)
            opt.zero_grad(set_to_none=True)
            if bypass:
                opt._failed = None  # the old code: on from the mixed state
            else:
                model(*batches[0])[1].backward()
                with pytest.raises(RuntimeError, match=r"step\(\) refused"):
                    opt.step()
                opt.zero_grad(set_to_none=True)
                load_checkpoint(ckpt, model=model, optimizer=opt)
        for batch in batches[:8]:
            loss = model(*batch)[1]
            losses.append(loss.item())  # compared at every step
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return losses, [p.detach().cpu() for p in model.parameters()]
    finally:
        opt.close()


@pytest.mark.cuda
@pytest.mark.parametrize("lane", [0.0, 0.5])
def test_a_failed_nvme_read_on_cuda_refuses_and_the_loaded_run_is_bit_identical(tmp_path,
                                                                                 lane):
    """CUDA twin (not run here: no GPU; the CPU kernel, torch's fused Adam on the GPU side and,
    lane=0.5, the GPU lane): a step whose NVMe state reads fail raises naming key and file,
    the next step() refuses (Note [failed steps]), and the run resumed from the checkpoint
    equals, at each of 8 steps, the same resume without the fault; must-fail twin: stepping on
    from the mixed state differs."""
    torch.manual_seed(1)
    model = TinyGPT().cuda()
    opt = HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.1, offload_fraction=0.75,
                     chunk_numel=1024, state_tier="nvme", nvme_dir=str(tmp_path),
                     param_sync="step", gpu_step_fraction=lane)
    for x, y in _batches()[:GOOD]:
        model(x.cuda(), y.cuda())[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    ckpt = tmp_path / "good.pt"
    save_checkpoint(ckpt, model=model, optimizer=opt)
    opt.close()
    ref_losses, ref_params = _cuda_resume(tmp_path, ckpt, lane, fault=False)
    losses, params = _cuda_resume(tmp_path, ckpt, lane, fault=True)
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    bad_losses, bad_params = _cuda_resume(tmp_path, ckpt, lane, fault=True, bypass=True)
    assert bad_losses != ref_losses or any(not torch.equal(a, b)
                                           for a, b in zip(bad_params, ref_params))


def test_a_spill_dir_that_turns_read_only_loses_nothing_and_says_why_it_stays(tmp_path,
                                                                              caplog):
    """The spill filesystem turns read-only (EROFS on every write, unlink and rmdir; as root a
    chmod would not stop the test's own process): a spill write fails naming the key and the
    file and the key stays readable in RAM, keys already spilled read back, close() raises
    nothing, and the log says the directory cannot be removed (it said it "holds files tiermem
    did not write", sending the user after files that are not there). A user's file beside
    it survives."""
    (tmp_path / FOREIGN).write_text("keep me")
    store = TierStore(StoreConfig(gpu_bytes=0, cpu_bytes=1 << 20, nvme_bytes=1 << 20,
                                  nvme_dir=str(tmp_path), io_backend="posix", o_direct=False))
    a, b = torch.arange(1000.0), torch.arange(2000.0)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system (injected)")

    try:
        store.put("a", a, "nvme")
        store.synchronize()
        spill_dir = store._spill.dir_path
        with pytest.MonkeyPatch.context() as mp:
            for name in ("pwritev", "unlink", "rmdir"):
                mp.setattr(os, name, read_only)
            with pytest.warns(RuntimeWarning, match=rf"spilling 'b' failed.*Errno {errno.EROFS}"
                                                    rf".*{store._spill.path}"):
                store.put("b", b, "nvme")
                store.synchronize()
            assert store.tier_of("b") == "cpu"
            assert torch.equal(store.get("a", "cpu"), a) and torch.equal(store.get("b", "cpu"), b)
            with caplog.at_level("WARNING", logger="tiermem"):
                store.close()
        left = [r.getMessage() for r in caplog.records if "left" in r.getMessage()]
        assert left and spill_dir in left[0] and "cannot be removed" in left[0], left
        assert not any("did not write" in m for m in left), left
    finally:
        store.close()
    assert (tmp_path / FOREIGN).read_text() == "keep me"


def test_offloaded_activations_cut_from_the_spill_file_fail_backward_and_training_goes_on(
        tmp_path):
    """Activation offload to NVMe, the spill file cut between a step's forward and its
    backward: backward raises SpillCorruption naming an activation key and the file (never
    zeros as activations), nothing stays live, and the steps after it train bit for bit like
    a run without offload that skips that batch. A user's file beside it survives close()."""
    from models import make_batch
    from tiermem.offload import offload_activations

    def train(offload: bool) -> list:
        torch.manual_seed(0)
        model = TinyGPT()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        store = off = None
        if offload:
            store = TierStore(StoreConfig(gpu_bytes=1 << 20, cpu_bytes=1 << 20,
                                          nvme_bytes=4 << 20, nvme_dir=str(tmp_path),
                                          io_backend="posix", o_direct=False))
            off = offload_activations(model.blocks, store=store, tier="nvme", num_layers=3)
        try:
            for step in range(5):
                if step == 2:  # this batch's backward fails (or, without offload, is skipped)
                    if offload:
                        with off:
                            loss = model(*make_batch(step))[1]
                        os.truncate(store._spill.path, 0)
                        with pytest.raises(SpillError, match="truncated|corrupted") as info:
                            loss.backward()
                        key, path = info.value.key, info.value.path
                        del loss, info  # the error's frames hold the graph until it is dropped
                        assert key[0] == "act" and path == store._spill.path
                        assert off.live_keys == 0 and len(store) == 0
                    opt.zero_grad(set_to_none=True)
                    continue
                with off if offload else contextlib.nullcontext():
                    loss = model(*make_batch(step))[1]
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        finally:
            if store is not None:
                store.close()
        return [p.detach().clone() for p in model.parameters()]

    (tmp_path / FOREIGN).write_text("keep me")
    ref = train(False)
    got = train(True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert sorted(os.listdir(tmp_path)) == [FOREIGN]


def test_a_streamed_nvme_home_whose_placement_writes_fail_keeps_them_in_ram_and_trains_exactly(
        tmp_path):
    """Weight streaming with an NVMe home (the LoRA base, staging_blocks): ENOSPC on some of
    the placement's writes warns naming the weight's key and the spill file, those weights
    stay in RAM (nothing lost), and LoRA training equals the run without streaming bit for
    bit; a user's file beside the spill directory survives close()."""
    pytest.importorskip("peft")
    import dataclasses

    from tiermem.models.lora_llama import SHAPES, adapter_parameters, lora_batches, lora_llama
    from tiermem.models.lora_stream import stream_lora_base

    shape = dataclasses.replace(SHAPES["tiny"], layers=4)

    def train(stream: bool) -> list:
        model = lora_llama(shape, seed=0)
        handle = store = None
        if stream:
            real, calls = posix_mod.os.pwritev, [0]

            def flaky(*args, **kwargs):
                calls[0] += 1
                if calls[0] in (2, 5, 9):
                    raise OSError(errno.ENOSPC, "No space left on device (injected)")
                return real(*args, **kwargs)

            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(posix_mod.os, "pwritev", flaky)
                with pytest.warns(RuntimeWarning, match=r"spilling \('tiermem.stream'.*Errno 28"
                                                        r".*spill\.bin") as seen:
                    handle, store = stream_lora_base(model, device="cpu", tier="nvme",
                                                     nvme_dir=str(tmp_path))
            assert any(store._spill.path in str(w.message) for w in seen)
        opt = torch.optim.AdamW(adapter_parameters(model), lr=2e-3)
        out = []
        try:
            for ids in lora_batches(shape.vocab, 2, 16, 4):
                loss = model(input_ids=ids, labels=ids).loss
                out.append(loss.detach().clone())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        finally:
            if handle is not None:
                handle.close()
                store.close()
        return out + [p.detach().clone() for p in adapter_parameters(model)]

    (tmp_path / FOREIGN).write_text("keep me")
    ref = train(False)
    got = train(True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert sorted(os.listdir(tmp_path)) == [FOREIGN]
