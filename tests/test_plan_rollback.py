"""The planner counts HybridAdam's rollback slots (``rollback_bytes``, Note [speculative step]):
host RAM for the chunks the CPU steps, GPU memory for the GPU lane's share (Note [lane rollback
on the GPU]), only where a step can speculate (``max_grad_norm`` set, or a GradScaler:
``grad_scaler=True``, Note [grad scaler overlap]; streamed weights too, Note [streamed
rollback]), and refuses a plan they overflow, naming the field. The slot counts are checked
against a real HybridAdam's, under clipping, under a GradScaler and with streamed weights."""

from __future__ import annotations

import json
import re

import pytest
import torch

from _examples import ROOT, load_example
from tiermem.apps.plan import plan
from tiermem.apps.plan.memory import rollback_slot_bytes
from tiermem.apps.plan.placement import ROLLBACK_ITEM
from tiermem.shapes import GiB

# the bench's reference GPT (24 blocks, d_model 2048): 80 chunks of 16M elements at f=1
KW = dict(n_layers=24, d_model=2048, n_heads=16, batch=8, seq=2048, offload_fraction=1.0,
          state_tier="cpu", chunk_numel=1 << 24, max_grad_norm=1.0, gpu_bytes="141GB",
          host_bytes="125GiB")
N = 1_340_000_000
SLOT = 4 * 3 * (1 << 24)  # one chunk's fp32 master + fp32 moments


def _item(pl):
    return next((i for i in pl.items if i.name == ROLLBACK_ITEM), None)


@pytest.mark.parametrize("lane,on_gpu", [(0.0, 0), (0.5, 10), (1.0, 21)])
def test_rollback_slots_are_counted_in_ram_and_the_lanes_share_on_the_gpu(lane, on_gpu):
    """4 GiB holds 21 slots of 192 MiB (4 KiB-rounded state blobs): the lane's share of them
    (int(21 x share)) on the GPU, the rest in host RAM; each tier's total grows by exactly that
    against the same plan without a budget."""
    with_ = plan(N, **KW, gpu_step_fraction=lane, rollback_bytes="4GiB")
    without = plan(N, **KW, gpu_step_fraction=lane, rollback_bytes=0)
    item = _item(with_)
    assert item is not None and _item(without) is None
    assert (item.host, item.gpu) == ((21 - on_gpu) * SLOT, on_gpu * SLOT)
    assert with_.used["host"] - without.used["host"] == item.host
    assert with_.used["gpu"] - without.used["gpu"] == item.gpu
    assert item.note.startswith("21 chunks' state")


def test_no_clipping_no_rollback_slots_and_at_most_one_per_chunk():
    """Without max_grad_norm nothing speculates: nothing is counted; a budget beyond every
    chunk's state holds one slot per chunk (80), no more."""
    assert _item(plan(N, **dict(KW, max_grad_norm=None), rollback_bytes="4GiB")) is None
    assert _item(plan(N, **KW, rollback_bytes="100GiB")).host == 80 * SLOT


def test_a_budget_the_ram_cannot_hold_is_refused_naming_the_field():
    """A plan that fits with no budget does not with 8 GiB of copies in the RAM left: the host
    reason names optimizer.rollback_bytes; on the GPU lane the copies go to the GPU instead."""
    base = plan(N, **KW, rollback_bytes=0)
    host = base.used["host"] + 4 * GiB  # room for 4 GiB of copies, not 8
    tight = dict(KW, host_bytes=host)
    assert plan(N, **tight, rollback_bytes="4GiB").fits
    pl = plan(N, **tight, rollback_bytes="8GiB")
    assert not pl.fits
    assert any(r.startswith("host") and "optimizer.rollback_bytes=8589934592" in r
               for r in pl.reasons), pl.reasons
    assert plan(N, **tight, rollback_bytes="8GiB", gpu_step_fraction=1.0).fits


def test_a_bad_budget_names_the_field():
    with pytest.raises(ValueError, match="rollback_bytes"):
        plan(N, **KW, rollback_bytes=-1)


NO_CLIP = dict(KW, max_grad_norm=None)


@pytest.mark.parametrize("lane,on_gpu", [(0.0, 0), (0.5, 10), (1.0, 21)])
def test_a_grad_scaler_counts_the_rollback_slots_as_clipping_does(lane, on_gpu):
    """fp16 under a GradScaler, no clipping (Note [grad scaler overlap]): the chunks speculate
    into the same slots, so ``grad_scaler=True`` gives the clip case's item, byte for byte,
    and the same growth of each tier; without it (and without clipping) there is none. Red
    before grad_scaler existed (the plan counted the slots only with max_grad_norm)."""
    clip = _item(plan(N, **KW, gpu_step_fraction=lane, rollback_bytes="4GiB"))
    with_ = plan(N, **NO_CLIP, gpu_step_fraction=lane, rollback_bytes="4GiB", grad_scaler=True)
    without = plan(N, **NO_CLIP, gpu_step_fraction=lane, rollback_bytes=0, grad_scaler=True)
    item = _item(with_)
    assert item is not None and _item(without) is None
    assert (item.host, item.gpu) == (clip.host, clip.gpu) == ((21 - on_gpu) * SLOT, on_gpu * SLOT)
    assert with_.used["host"] - without.used["host"] == item.host
    assert with_.used["gpu"] - without.used["gpu"] == item.gpu
    assert _item(plan(N, **NO_CLIP, gpu_step_fraction=lane, rollback_bytes="4GiB")) is None
    assert with_.inputs["grad_scaler"] is True


def test_grad_scaler_must_be_a_bool():
    with pytest.raises(TypeError, match=r"grad_scaler='on' must be True"):
        plan(N, **KW, grad_scaler="on")


@pytest.mark.parametrize("clip,scaler", [(1.0, False), (None, True), (1.0, True)])
def test_streamed_weights_count_their_rollback_slots(clip, scaler):
    """Streamed weights' chunks speculate too (Note [streamed rollback], Note [streamed grad
    scaler]; HybridAdam allocates the same slots: the runtime test below), so a streamed plan
    counts them as a resident one does, and times the chunks they hold. Red on the old code,
    which left them out whenever weights were streamed."""
    kw = dict(KW, max_grad_norm=clip, grad_scaler=scaler, stream_weights=True)
    pl = plan(N, **kw, rollback_bytes="4GiB")
    none = plan(N, **kw, rollback_bytes=0)
    assert pl.stream is not None and none.stream is not None
    item = _item(pl)
    assert item is not None and _item(none) is None
    assert (item.host, item.gpu) == rollback_slot_bytes(N, 1 << 24, torch.float32, 4 * GiB,
                                                        0.0) == (21 * SLOT, 0)
    assert pl.used["host"] - none.used["host"] == item.host
    assert pl.step_time.speculated_chunks == 21 and none.step_time.speculated_chunks == 0
    assert pl.step_time.overlapped_s < none.step_time.overlapped_s
    free = plan(N, **dict(kw, max_grad_norm=None, grad_scaler=False), rollback_bytes="4GiB")
    assert free.stream is not None and _item(free) is None  # nothing waits: no slots


def _run_hybrid(clip, scaler, lane, streamed, budget, steps=3):
    """A real HybridAdam (TinyGPT, one param group, 1024-element chunks) trained ``steps``
    steps, under a CPU GradScaler or not, its blocks streamed or not: ``(host, GPU)`` bytes
    of its rollback slots, the offloaded elements, the last step's speculated chunks."""
    from models import make_batch
    from optim.test_grad_scaler_overlap import _admitted_done
    from optim.test_hybrid_adam import HP, make_models
    from tiermem import StoreConfig, TierStore
    from tiermem.optim import HybridAdam
    from tiermem.stream import stream_weights
    model = make_models()
    store = stream = None
    if streamed:
        store = TierStore(StoreConfig(device="cpu", gpu_bytes=0, cpu_bytes=8 << 20,
                                      pool_slab_bytes=1 << 20))
        stream = stream_weights(model.blocks, store=store)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                     placement="given", max_grad_norm=clip, gpu_step_fraction=lane,
                     rollback_bytes=budget)
    try:
        gs = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12) if scaler else None
        for step in range(steps):
            loss = model(*make_batch(step))[1]
            (loss if gs is None else gs.scale(loss)).backward()
            if opt._spec.active:
                _admitted_done(opt)  # every chunk that may speculate has: the count is exact
            if gs is None:
                opt.step()
            else:
                gs.step(opt)
                gs.update()
            opt.zero_grad(set_to_none=True)
        opt.synchronize()
        spec = opt._spec
        return ((spec.held_bytes() - spec.gpu_held_bytes(), spec.gpu_held_bytes()),
                opt.state_numel()["offloaded"], opt.step_stats()["speculated_chunks"])
    finally:
        opt.close()
        if stream is not None:
            stream.close()
            store.close()


@pytest.mark.parametrize("clip,scaler,lane,streamed", [
    (1.0, False, 0.5, False), (None, True, 0.0, False), (None, True, 0.5, False),
    (None, True, 1.0, False), (1.0, False, 0.0, True), (None, True, 0.0, True),
    (None, False, 0.5, False)])
def test_the_formula_matches_hybrid_adams_slots_under_a_scaler_and_streamed(
        clip, scaler, lane, streamed, one_thread):
    """What the plan's ``grad_scaler`` and streamed rows rest on: a HybridAdam under a CPU
    GradScaler without clipping allocates exactly the clip case's slots (``Speculation._alloc``
    runs alike once ``enable_scaler`` turned it on: the same count, the same lane share) and
    speculates on them; with streamed weights too. Twin: neither clipping nor a scaler
    allocates nothing, though the formula would give the same bytes (so a plan counting them
    there would be wrong)."""
    budget = 5 * 4 * 3 * 1024 + 100  # 5 slots of 1024 elements' fp32 state
    held, off, speculated = _run_hybrid(clip, scaler, lane, streamed, budget)
    formula = rollback_slot_bytes(off, 1024, torch.float32, budget, lane)
    assert sum(formula) == 5 * 4 * 3 * 1024
    if clip is None and not scaler:
        assert held == (0, 0) and speculated == 0
    else:
        assert held == formula and speculated == 5


@pytest.mark.parametrize("lane", [0.0, 0.5, 1.0])
def test_the_formula_matches_hybrid_adams_slots(lane, one_thread):
    """The planner's (host, GPU) bytes equal what a HybridAdam with one param group allocates
    (on the CPU: its lane's "device" slots are CPU tensors, counted by the lane)."""
    from models import make_batch
    from optim.test_hybrid_adam import HP, make_models
    from tiermem.optim import HybridAdam
    model = make_models()
    budget = 5 * 4 * 3 * 1024 + 100
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                     placement="given", max_grad_norm=1.0, gpu_step_fraction=lane,
                     rollback_bytes=budget)
    model(*make_batch(0))[1].backward()
    opt.step()
    off = opt.state_numel()["offloaded"]
    host, gpu = rollback_slot_bytes(off, 1024, torch.float32, budget, lane)
    assert (opt._spec.held_bytes() - opt._spec.gpu_held_bytes(), opt._spec.gpu_held_bytes()) \
        == (host, gpu)
    assert host + gpu > 0
    opt.close()


def test_the_20b_ram_preset_has_ram_for_36_slots_and_not_for_what_its_last_backward_overlaps():
    """The decision behind the 20B RAM preset's missing budget (docs/configuration.md): its
    plan holds 4 GiB of copies (the 4.5 GiB left of the store's budget: 36 slots of 128 MiB
    at most), not the ~14.4 GiB (115 chunks) the last of its 16 backward passes could overlap;
    the refusal names the field."""
    module = load_example("train_large", "train_large_rb")
    path = str(ROOT / "examples" / "configs" / "large" / "h200_20b_ram.yaml")
    assert module.load(path)["optimizer"].rollback_bytes == 0  # the preset sets none
    fits = module.make_plan(module.load(path, overrides=["optimizer.rollback_bytes=4GiB"]))
    item = _item(fits)
    assert fits.fits and item.host == 32 * 4 * 2 * (1 << 24) and item.gpu == 0
    big = module.make_plan(module.load(path, overrides=["optimizer.rollback_bytes=15GiB"]))
    assert not big.fits
    assert any(r.startswith("host") and "optimizer.rollback_bytes" in r for r in big.reasons)


# ---------------------------------------------------------------- tiermem plan --rollback-bytes

CLI = ["--params", str(N), "--layers", "24", "--d-model", "2048", "--heads", "16", "--batch", "8",
       "--seq", "2048", "--offload-fraction", "1", "--state-tier", "cpu",
       "--host-bytes", "125GiB"]
"""KW on the command line (the plan's own chunk size: 80 chunks of 16M elements here too)."""


def _row(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(ROLLBACK_ITEM)]


@pytest.mark.parametrize("lane,on_gpu", [(0.0, 0), (0.5, 10)])
def test_the_command_shows_the_rollback_slots_in_its_memory_table(lane, on_gpu, capsys):
    """``--rollback-bytes 4GiB`` with ``--max-grad-norm``: the table's row holds 21 slots'
    bytes, the lane's share in the GPU column; JSON carries the exact bytes; without
    ``--max-grad-norm`` (nothing speculates) there is no row."""
    from tiermem.apps.plan import main
    argv = CLI + ["--max-grad-norm", "1", "--gpu-step-fraction", str(lane),
                  "--rollback-bytes", "4GiB"]
    assert main(argv) == 0
    row = _row(capsys.readouterr().out)
    assert len(row) == 1
    gpu, host, nvme, note = re.split(r"\s{2,}", row[0][len(ROLLBACK_ITEM):].strip())
    assert gpu == (f"{on_gpu * SLOT / GiB:,.1f} GiB" if on_gpu else "-") and nvme == "-"
    assert host == f"{(21 - on_gpu) * SLOT / GiB:,.1f} GiB" and note.startswith("21 chunks'")
    assert main(argv + ["--json"]) == 0
    item = next(i for i in json.loads(capsys.readouterr().out)["items"]
                if i["name"] == ROLLBACK_ITEM)
    assert (item["host"], item["gpu"]) == ((21 - on_gpu) * SLOT, on_gpu * SLOT)
    assert main(CLI + ["--rollback-bytes", "4GiB"]) == 0
    assert _row(capsys.readouterr().out) == []


def test_the_command_refuses_a_budget_that_alone_does_not_fit_with_the_largest_that_does(capsys):
    """RAM for 6.5 slots beside a plan that fits without a budget: ``--rollback-bytes 8GiB``
    (42 slots) is refused in one line on stderr, exit 2, naming the flag, its field and the
    fix: 6 slots' budget, which fits, where 7 do not."""
    from tiermem.apps.plan import main
    base = plan(N, **KW, rollback_bytes=0)
    host = base.used["host"] + 6 * SLOT + SLOT // 2
    argv = CLI[:-2] + ["--host-bytes", str(host), "--max-grad-norm", "1"]
    assert main(argv + ["--rollback-bytes", str(6 * SLOT)]) == 0
    capsys.readouterr()
    assert main(argv + ["--rollback-bytes", "8GiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("tiermem plan: error: --rollback-bytes 8589934592 "
                          "(optimizer.rollback_bytes) does not fit")
    assert "the host needs" in err and f"fix: --rollback-bytes {6 * SLOT} or less" in err
    assert main(argv + ["--rollback-bytes", str(7 * SLOT)]) == 2
    assert f"fix: --rollback-bytes {6 * SLOT} or less" in capsys.readouterr().err


def test_the_command_counts_the_slots_under_grad_scaler_without_clipping(capsys):
    """``tiermem plan --grad-scaler --rollback-bytes 4GiB`` (no --max-grad-norm): exit 0, the
    row with 21 slots in RAM, the step waiting for the scaler's verdict; JSON has the exact
    bytes and the input. Red before the flag existed (exit 2: unrecognized argument)."""
    from tiermem.apps.plan import main
    argv = CLI + ["--grad-scaler", "--rollback-bytes", "4GiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    row = _row(out)
    assert len(row) == 1
    gpu, host, nvme, note = re.split(r"\s{2,}", row[0][len(ROLLBACK_ITEM):].strip())
    assert (gpu, nvme) == ("-", "-") and host == f"{21 * SLOT / GiB:,.1f} GiB"
    assert note.startswith("21 chunks'")
    assert "wait for the GradScaler's verdict" in out
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    item = next(i for i in data["items"] if i["name"] == ROLLBACK_ITEM)
    assert (item["host"], item["gpu"]) == (21 * SLOT, 0) and data["inputs"]["grad_scaler"]


def test_the_command_refuses_a_budget_that_alone_does_not_fit_under_grad_scaler(capsys):
    """Note [rollback refusal] under a scaler without clipping: RAM for 6.5 slots, ``--grad-
    scaler --rollback-bytes 8GiB`` is refused in one line (exit 2) naming the flag, its field,
    the largest budget that fits and what the chunks wait for at 0."""
    from tiermem.apps.plan import main
    base = plan(N, **NO_CLIP, rollback_bytes=0, grad_scaler=True)
    host = base.used["host"] + 6 * SLOT + SLOT // 2
    argv = CLI[:-2] + ["--host-bytes", str(host), "--grad-scaler"]
    assert main(argv + ["--rollback-bytes", str(6 * SLOT)]) == 0
    capsys.readouterr()
    assert main(argv + ["--rollback-bytes", "8GiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("tiermem plan: error: --rollback-bytes 8589934592 "
                          "(optimizer.rollback_bytes) does not fit")
    assert f"fix: --rollback-bytes {6 * SLOT} or less" in err
    assert err.endswith("or 0 (every chunk waits for the scaler's verdict)")
    assert main(argv[:-1] + ["--rollback-bytes", "8GiB"]) == 0  # no scaler, no clip: no slots


def test_a_plan_that_does_not_fit_without_the_budget_is_reported_as_any_other(capsys):
    """Too little RAM even with no budget: exit 1, the table's reason names the field."""
    from tiermem.apps.plan import main
    argv = CLI[:-2] + ["--host-bytes", "20GiB", "--max-grad-norm", "1"]
    assert main(argv + ["--rollback-bytes", "4GiB"]) == 1
    out = capsys.readouterr()
    assert out.err == "" and "optimizer.rollback_bytes=4294967296 holds" in out.out
    assert main(argv + ["--rollback-bytes", "lots"]) == 2
    assert "rollback_bytes" in capsys.readouterr().err


# ---------------------------------------------------------------- the step with speculated chunks

def _hand_case(**kw):
    """GPU 1.0 s (6 x 1e9 params x 1,000 tokens at 6 TFLOP/s), so the last backward's window is
    4/6 s; CPU Adam 1.0 s for 1e9 offloaded params in 10 chunks; PCIe and NVMe next to nothing,
    no worker time: the optimizer phase is 1.0 s."""
    import dataclasses
    from tiermem.apps.plan import MachineRates, step_time
    rates = dataclasses.replace(MachineRates(), gpu_flops=6e12, cpu_adam_params_per_s=1e9,
                                worker_s_per_chunk=0.0, pcie_h2d_bytes_per_s=1e18,
                                pcie_d2h_bytes_per_s=1e18, pcie_both_bytes_per_s=2e18)
    return step_time(active_params=10**9, offloaded_params=10**9, param_bytes=2,
                     micro_batch_tokens=1000, offloaded_chunks=10, n_layers=4, rates=rates,
                     **kw)


@pytest.mark.parametrize("speculated, spec_s, step_s", [
    (0, 0.0, 2.0),        # every chunk waits for the norm: GPU 1 + the whole phase 1
    (4, 0.4, 1.6),        # 0.4 s inside the 2/3 s window, the other 6 chunks' 0.6 s after
    (6, 0.6, 1.4),
    (8, 0.8, 4 / 3),      # 0.8 - 2/3 past the window + 0.2: as without clipping
    (10, 1.0, 4 / 3),
])
def test_the_speculated_chunks_overlap_the_backward_and_the_rest_wait(speculated, spec_s,
                                                                      step_s):
    """Note [speculated chunks] on a hand-computed case: the first ``s`` of 10 chunks (what
    the budget holds) take s/10 of the 1.0 s phase and overlap the 2/3 s backward window as
    without clipping; what outlasts the window, then the waiting chunks, follow the backward.
    Enough speculated chunks give the unclipped step (4/3 s)."""
    st = _hand_case(max_grad_norm=1.0, speculated_chunks=speculated)
    assert st.optimizer_overlapped_s == pytest.approx(1.0)
    assert st.speculated_chunks == speculated and st.speculated_s == pytest.approx(spec_s)
    assert st.overlapped_s == pytest.approx(step_s)
    assert st.overlap_window_s == pytest.approx(2 / 3 if speculated else 0.0)
    assert _hand_case().overlapped_s == pytest.approx(4 / 3)  # no clipping


def test_the_waiting_chunks_run_beside_the_next_forward_with_forward_sync():
    """param_sync="forward": the next forward (1/3 s: one micro-batch's) overlaps only the
    chunks that waited for the norm: 4 speculated -> 1 + max(0, 0.4 - 2/3) + (0.6 - 1/3)."""
    kw = dict(max_grad_norm=1.0, param_sync="forward")
    assert _hand_case(**kw).overlapped_s == pytest.approx(1 + 2 / 3)
    assert _hand_case(**kw, speculated_chunks=4).overlapped_s == pytest.approx(1 + 0.6 - 1 / 3)
    assert _hand_case(**kw, speculated_chunks=10).overlapped_s == pytest.approx(4 / 3)


@pytest.mark.parametrize("speculated, step_s", [(0, 2.0), (4, 1.6), (10, 4 / 3)])
def test_under_a_grad_scaler_the_chunks_wait_for_the_verdict_as_for_the_norm(speculated,
                                                                              step_s):
    """Note [scaler verdict]: without clipping, a GradScaler's step is timed as a clipped one:
    no overlap but the speculated chunks' (the 2.0 s with none is what the old model, which
    saw no clipping, put at 4/3 s); clipping as well changes nothing."""
    st = _hand_case(grad_scaler=True, speculated_chunks=speculated)
    assert st.overlapped_s == pytest.approx(step_s)
    assert st.overlapped_s == pytest.approx(
        _hand_case(max_grad_norm=1.0, speculated_chunks=speculated).overlapped_s)
    assert st.overlapped_s == pytest.approx(_hand_case(
        max_grad_norm=1.0, grad_scaler=True, speculated_chunks=speculated).overlapped_s)
    assert st.grad_scaler and st.speculated_s == pytest.approx(speculated / 10)


def test_under_a_grad_scaler_alone_the_next_forward_overlaps_only_held_chunks():
    """param_sync="forward" under a scaler without clipping: with no budget the chunks queue
    in backward order as their gradients land (no forward beside them: 1 + 1 s); with 4
    speculated the held ones go in forward order, as with clipping (Note [held chunks])."""
    kw = dict(grad_scaler=True, param_sync="forward")
    assert _hand_case(**kw).overlapped_s == pytest.approx(2.0)
    assert _hand_case(**kw).forward_overlap_s == 0.0
    assert _hand_case(**kw, speculated_chunks=4).overlapped_s == pytest.approx(1 + 0.6 - 1 / 3)
    with pytest.raises(TypeError, match="grad_scaler=1 must be True"):
        _hand_case(grad_scaler=1)


def test_the_plan_times_a_grad_scaler_as_clipping():
    """plan(grad_scaler=True) without max_grad_norm: the 21 chunks of 4 GiB speculate and the
    step is the clip case's; no budget: the clipped step (every chunk waits for the verdict),
    slower than the free one. Red before grad_scaler existed."""
    clip = plan(N, **KW, rollback_bytes="4GiB").step_time
    four = plan(N, **NO_CLIP, rollback_bytes="4GiB", grad_scaler=True)
    waits = plan(N, **NO_CLIP, rollback_bytes=0, grad_scaler=True).step_time
    free = plan(N, **NO_CLIP, rollback_bytes="4GiB").step_time
    assert four.step_time.speculated_chunks == 21 and free.speculated_chunks == 0
    assert four.step_time.overlapped_s == pytest.approx(clip.overlapped_s)
    assert waits.overlapped_s == pytest.approx(plan(N, **KW, rollback_bytes=0).step_time
                                               .overlapped_s)
    assert free.overlapped_s < four.step_time.overlapped_s < waits.overlapped_s
    table = four.table()
    assert "the other 59 wait for the GradScaler's verdict" in table
    assert "rolled back if the scaler skips the step" in table


def test_bad_speculated_chunks_are_refused_in_one_line():
    for kw in (dict(max_grad_norm=1.0, speculated_chunks=11), dict(speculated_chunks=1)):
        with pytest.raises(ValueError, match=r"speculated_chunks=\d+ needs max_grad_norm"):
            _hand_case(**kw)


def test_the_plan_times_the_chunks_its_budget_holds():
    """plan(): the 21 slots of 4 GiB are the speculated chunks of 80; 100 GiB holds a slot for
    every chunk, so the step is the unclipped one; without a budget the clipped one."""
    clipped = plan(N, **KW, rollback_bytes=0).step_time
    four = plan(N, **KW, rollback_bytes="4GiB").step_time
    every = plan(N, **KW, rollback_bytes="100GiB").step_time
    free = plan(N, **dict(KW, max_grad_norm=None), rollback_bytes="4GiB").step_time
    assert (clipped.speculated_chunks, four.speculated_chunks, every.speculated_chunks) == \
        (0, 21, 80) and four.moved["offloaded_chunks"] == 80
    assert four.speculated_s == pytest.approx(four.optimizer_overlapped_s * 21 / 80)
    assert free.overlapped_s < four.overlapped_s < clipped.overlapped_s
    assert every.overlapped_s == pytest.approx(free.overlapped_s)
    assert "the 21 of 80 chunks the rollback budget lets speculate" in \
        plan(N, **KW, rollback_bytes="4GiB").table()


def test_the_20b_presets_dry_run_prints_the_speculated_chunks(capsys):
    """examples/train_large.py --dry-run of the 20B RAM preset with a 4 GiB budget: its plan's
    step lines name the 32 chunks that speculate and the rest that wait for the norm."""
    module = load_example("train_large", "train_large_dry")
    path = str(ROOT / "examples" / "configs" / "large" / "h200_20b_ram.yaml")
    assert module.main(["--config", path, "--dry-run", "optimizer.rollback_bytes=4GiB"]) == 0
    out = capsys.readouterr().out
    chunks = re.search(r"with the 32 of (\d+) chunks the rollback budget lets speculate", out)
    assert chunks, out
    assert f"the other {int(chunks.group(1)) - 32} wait for the global norm" in out
