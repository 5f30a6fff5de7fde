"""Note [lane rollback on the GPU]: chunks of the GPU lane keep their pre-step copies in device
slots of the lane (a copy of the lane slot their state was loaded into), not in host RAM, so
the worker makes no memcpy of their state; the budget's slots are split between the GPU (the
lane chunks among the first chunks of the speculating order) and host RAM (the rest). On the
CPU the lane's "device" is the CPU, so these tests check the decisions and counts (which
chunks take which slots, which copies the worker makes) and bit-identity to the run that never
speculates; tests/optim/test_speculate_cuda.py runs the same on a GPU.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from models import make_batch
from optim.test_hybrid_adam import HP, make_models
from optim.test_speculate import STEPS, assert_same_bits, refused_step
from tiermem.optim import HybridAdam, gpu_lane, speculate
from tiermem.optim.layout import chunk_state_bytes

KW = dict(**HP, offload_fraction=1.0, chunk_numel=1024, placement="given")


class _Copies:
    """Records the chunks whose state the worker copies into (or restores from) a host slot, and
    those the lane copies on its device."""

    def __init__(self, monkeypatch) -> None:
        self.host: list[tuple[int, int]] = []
        self.device: list[tuple[int, int]] = []
        prepare, mark = speculate.Speculation.prepare, speculate.Speculation.mark_saved
        rec = self

        def prepare_and_record(self, item, blob):
            if item in self._admitted:
                rec.host.append(item)
            return prepare(self, item, blob)

        def mark_and_record(self, item):
            rec.device.append(item)
            return mark(self, item)

        monkeypatch.setattr(speculate.Speculation, "prepare", prepare_and_record)
        monkeypatch.setattr(speculate.Speculation, "mark_saved", mark_and_record)


def _train(kw: dict, max_norm: float, scale) -> tuple:
    """``STEPS`` steps of the test model, loss scaled by ``scale(step)``; (model, optimizer,
    per-step (speculated, rolled back))."""
    model = make_models()
    opt = HybridAdam(model.parameters(), **kw, max_grad_norm=max_norm)
    counts = []
    for step in range(STEPS):
        (model(*make_batch(step))[1] * scale(step)).backward()
        if opt._spec.active:  # let the worker admit what it may before step() decides
            with opt._step.idle:  # (a busy box otherwise admitted none on some steps)
                opt._step.idle.wait_for(lambda: not opt._step.outstanding, timeout=120.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        st = opt.step_stats()
        counts.append((st["speculated_chunks"], st["rolled_back_chunks"]))
    return model, opt, counts


def _chunks(opt) -> list[tuple[int, int]]:
    return [(g.index, c) for g in opt._groups for c in range(len(g.plan.chunks))]


@pytest.mark.parametrize("regime", ["never", "always"])
def test_lane_chunks_keep_their_copies_on_the_lane_device_not_in_host_ram(
        regime, monkeypatch, one_thread):
    """Every chunk on the lane, room for every chunk: all slots are the lane's device slots,
    no host RAM is held, the worker copies no lane chunk's state on the host (the old code made
    a host memcpy per admitted lane chunk), the bytes held are the device's (in
    memory_bytes()["gpu"]); and bit-identical to the waiting run over 8 steps, rolled back
    (always) or not (never)."""
    copies = _Copies(monkeypatch)
    max_norm, scale = (1.0, lambda s: 1e-2) if regime == "never" else (1e-3, lambda s: 1.0)
    kw = dict(KW, gpu_step_fraction=1.0)
    model, opt, counts = _train(dict(kw, rollback_bytes=1 << 30), max_norm, scale)
    ref, ref_opt, ref_counts = _train(dict(kw, rollback_bytes=0), max_norm, scale)
    n = len(_chunks(opt))
    spec = opt._spec
    assert spec._slots == [] and len(opt._lane.rollback) == n
    slot = chunk_state_bytes(1024, torch.float32)
    assert spec.gpu_held_bytes() == spec.held_bytes() == n * 3 * 4 * 1024 <= n * slot
    assert opt.step_stats()["rollback_held_bytes"] == spec.held_bytes()
    assert opt.memory_bytes()["gpu"] >= opt._lane.device_bytes() >= spec.gpu_held_bytes()
    assert copies.host == []  # no host memcpy of a lane chunk's state
    assert sum(s for s, _ in counts) == len(copies.device) > 0
    if regime == "always":  # speculates at step 0 (placement given) and 1, then off
        assert [r > 0 for _, r in counts[:2]] == [True, True]
        assert all(s == 0 for s, _ in counts[2:]), counts
    else:
        assert all(s > 0 and r == 0 for s, r in counts), counts
    assert all(c == (0, 0) for c in ref_counts)
    assert_same_bits(model, opt.state_dict(), ref, ref_opt.state_dict())
    opt.close(), ref_opt.close()


def test_the_budget_is_split_by_the_speculating_order(monkeypatch, one_thread):
    """Half the chunks on the lane, room for 5 chunks: the device gets as many slots as there
    are lane chunks among the first 5 chunks of the backward order, host RAM the rest; each
    admitted chunk holds a slot of its kind (a lane chunk a host one only when the device's
    are taken); always clipping, bit-identical to the waiting run."""
    copies = _Copies(monkeypatch)
    slot = chunk_state_bytes(1024, torch.float32)
    kw = dict(KW, gpu_step_fraction=0.5)
    model, opt, counts = _train(dict(kw, rollback_bytes=5 * slot), 1e-3, lambda s: 1.0)
    ref, ref_opt, _ = _train(dict(kw, rollback_bytes=0), 1e-3, lambda s: 1.0)
    order = _chunks(opt)[::-1]
    lane = opt._lane.chunks
    n_gpu = sum(1 for item in order[:5] if item in lane)
    assert 0 < n_gpu < 5 and len(order) > 5
    assert len(opt._lane.rollback) == n_gpu and len(opt._spec._slots) == 5 - n_gpu
    assert set(copies.device) <= lane  # device slots hold lane chunks only
    assert all(item not in lane for item in copies.host) or len(copies.device) >= n_gpu
    assert copies.device and copies.host
    assert all(s <= 5 for s, _ in counts) and counts[0][0] == counts[0][1] > 0
    assert_same_bits(model, opt.state_dict(), ref, ref_opt.state_dict())
    opt.close(), ref_opt.close()


def test_no_device_room_keeps_the_lane_copies_in_host_ram(monkeypatch, caplog, one_thread):
    """The lane's device slots cannot be allocated (out of memory): every slot is in host RAM
    (logged), lane chunks are copied there by the worker, and the result stays bit-identical."""
    def oom(self, n):
        raise torch.OutOfMemoryError("test: no room")

    monkeypatch.setattr(gpu_lane.GpuLane, "alloc_rollback", oom)
    copies = _Copies(monkeypatch)
    kw = dict(KW, gpu_step_fraction=1.0)
    with caplog.at_level(logging.INFO, logger="tiermem"):
        model, opt, counts = _train(dict(kw, rollback_bytes=1 << 30), 1e-3, lambda s: 1.0)
    assert "kept in host RAM" in caplog.text
    assert opt._lane.rollback == [] and len(opt._spec._slots) == len(_chunks(opt))
    assert copies.device == [] and len(copies.host) > 0
    ref, ref_opt, _ = _train(dict(kw, rollback_bytes=0), 1e-3, lambda s: 1.0)
    assert_same_bits(model, opt.state_dict(), ref, ref_opt.state_dict())
    opt.close(), ref_opt.close()


def test_a_refused_step_restores_lane_chunks_from_their_device_copies(monkeypatch, one_thread):
    """step() refuses a step (nan lr) after lane chunks were stepped speculatively: their blobs
    (overwritten by the speculative write-back) and params come back from the device copies;
    training goes on bit-identical to the run that never speculated."""
    admitted = []
    admit = speculate.Speculation.admit

    def admit_and_record(self, item):
        ok = admit(self, item)
        if ok:
            admitted.append(item)
        return ok

    monkeypatch.setattr(speculate.Speculation, "admit", admit_and_record)
    runs = []
    for budget in (1 << 30, 0):
        model = make_models()
        opt = HybridAdam(model.parameters(), **KW, gpu_step_fraction=1.0, max_grad_norm=1.0,
                         rollback_bytes=budget)
        for step in range(STEPS):
            (model(*make_batch(step))[1] * 1e-2).backward()
            if step == 3:
                if budget:
                    opt._step.drain()  # every shipped chunk was stepped speculatively
                    assert admitted and opt._spec._saved
                refused_step(opt)
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
        runs.append((model, opt.state_dict()))
        opt.close()
    assert_same_bits(*runs[0], *runs[1])


@pytest.mark.parametrize("tier,regime", [("cpu", "never"), ("cpu", "always"), ("nvme", "never")])
def test_chunks_beyond_the_budget_are_stepped_in_forward_order(tier, regime, tmp_path,
                                                               monkeypatch, one_thread):
    """Note [held chunks]: room for 3 chunks; the first steps speculate 3 chunks (the last ones:
    backward order) and the others, held until step() has the norm, are stepped in forward
    order (the order a param_sync="forward" forward needs them in; the old code stepped them in
    backward order), or with NVMe chunks in the order they were held (the read-ahead's);
    bit-identical to the waiting run."""
    from tiermem.optim.step_state import StepState
    order: list = []
    issued = StepState.chunk_issued

    def record(self, item, event):
        order.append(item)
        return issued(self, item, event)

    monkeypatch.setattr(StepState, "chunk_issued", record)
    held_order: list = []  # per step: the chunks claim() held, in that order
    claim = speculate.Speculation.claim

    def claim_and_record(self, item):
        ok = claim(self, item)
        if not ok and item not in held_order[-1]:
            held_order[-1].append(item)
        return ok

    monkeypatch.setattr(speculate.Speculation, "claim", claim_and_record)
    admitted = threading.Semaphore(0)  # one release per chunk admitted before the norm
    admit = speculate.Speculation.admit

    def admit_and_tell(self, item):
        first = item not in self._admitted and item not in self._admitted_gpu
        ok = admit(self, item)
        if ok and first:
            admitted.release()
        return ok

    monkeypatch.setattr(speculate.Speculation, "admit", admit_and_tell)
    slot = chunk_state_bytes(1024, torch.float32)
    max_norm, scale = (1.0, lambda s: 1e-2) if regime == "never" else (1e-3, lambda s: 1.0)
    kw = dict(KW, param_sync="forward")
    if tier == "nvme":
        kw.update(state_tier="nvme", nvme_dir=str(tmp_path))
    model = make_models()
    opt = HybridAdam(model.parameters(), **kw, max_grad_norm=max_norm, rollback_bytes=3 * slot)
    chunks = _chunks(opt)
    steps = []
    for step in range(STEPS):
        order.clear()
        held_order.append([])
        (model(*make_batch(step))[1] * scale(step)).backward()
        if regime == "never" or step < 2:  # a speculating step: let the worker admit its 3
            for _ in range(3):             # before step() decides (else a busy box flakes)
                admitted.acquire()
        opt.step()
        opt.synchronize()
        opt.zero_grad(set_to_none=True)
        st = opt.step_stats()
        steps.append((list(order), st["speculated_chunks"], st["rolled_back_chunks"]))
    for k, (seen, spec, rolled) in enumerate(steps):
        if regime == "always" and k >= 2:  # the switch is off: forward order, as waiting
            assert spec == 0 and seen == chunks, (k, seen)
            continue
        assert spec == 3 and rolled == (3 if regime == "always" else 0), (k, spec, rolled)
        first, rest = seen[:3], seen[3:]
        held = [c for c in chunks if c not in first]  # in forward order
        assert len(held) == len(chunks) - 3 and sorted(held_order[k]) == held, (k, seen)
        if regime == "always":  # the held ones, then the three rolled back
            assert rest == held + first, (k, seen)
        else:  # forward order; with NVMe the order they were held in (arrival)
            assert rest == (held_order[k] if tier == "nvme" else held), (k, seen)
            assert tier == "nvme" or held_order[k] != held  # arrival order is not forward
    ref = make_models()
    kw_ref = dict(kw, nvme_dir=str(tmp_path / "ref")) if tier == "nvme" else kw
    if tier == "nvme":
        (tmp_path / "ref").mkdir()
    ref_opt = HybridAdam(ref.parameters(), **kw_ref, max_grad_norm=max_norm, rollback_bytes=0)
    for step in range(STEPS):
        (ref(*make_batch(step))[1] * scale(step)).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    ref_opt.synchronize()
    assert_same_bits(model, opt.state_dict(), ref, ref_opt.state_dict())
    opt.close(), ref_opt.close()
