"""Note [speculative step]: with ``max_grad_norm`` and ``rollback_bytes``, offloaded chunks step
during backward as if the clip coefficient were 1, and are rolled back and stepped again when
``step()`` finds it is not. The reference is an independent HybridAdam with the same arguments
and ``rollback_bytes=0`` (today's path: every chunk waits for the norm): parameters, moments
and step counts must be bit-identical after 8 steps, for every state tier, the GPU lane (on the
CPU here), accumulation and ``param_sync="forward"``, in four regimes: (a) the norm never
exceeds the threshold, (b) it always does, (c) it alternates, (d) one step's norm is inf
(finite gradients: the coefficient is 0) and the last step's gradients are nan. The decisions
(which steps speculate, which roll back) follow Note [speculation switch] and are asserted
step by step.
"""

from __future__ import annotations

import threading

import pytest
import torch

from models import make_batch
from optim.test_hybrid_adam import HP, make_models, param_groups
from tiermem import StoreConfig, TierStore
from tiermem.optim import HybridAdam
from tiermem.optim import speculate
from tiermem.optim.speculate import SWITCH_MAX_CLIPPED, SWITCH_WINDOW, SpeculationSwitch

STEPS = 8
BUDGET = 1 << 30  # every chunk fits

# regime -> (max_grad_norm, loss scale per step): the scale sets the norm (premise asserted)
REGIMES = {
    "never": (1.0, lambda s: 1e-2),
    "always": (1e-3, lambda s: 1.0),
    "alternate": (1.0, lambda s: 10.0 if s % 2 else 1e-2),
    "nonfinite": (1.0, lambda s: {2: 1e30, 7: float("nan")}.get(s, 1e-2)),
    "burst": (1.0, lambda s: 10.0 if s < 4 else 1e-2),
}
# regime -> steps that speculate / that roll back (trace placement: step 0 only records the
# gradient order, so it never speculates; Note [speculation switch] for the rest)
DECISIONS = {
    "never": ({1, 2, 3, 4, 5, 6, 7}, set()),
    "always": ({1}, {1}),  # two clipped steps in four: off for good
    "alternate": ({1, 2, 3}, {1, 3}),  # F T F T: off from step 4
    "nonfinite": ({1, 2, 3, 4, 5, 6, 7}, {2, 7}),  # inf at 2, nan at 7: one in four each time
    "burst": ({1, 7}, {1}),  # clipped 0-3: off at 2, on again once 3 of the last 4 did not clip
}


def _config(name: str, tmp_path, run: str) -> tuple[dict, int]:
    """HybridAdam keyword arguments of configuration ``name`` (a fresh store or spill directory
    per run) and its backward passes per step."""
    base = dict(**HP, chunk_numel=1024, offload_fraction=0.5)
    if name == "cpu":
        return base, 1
    if name == "nvme":
        (tmp_path / run).mkdir()
        return dict(base, state_tier="nvme", nvme_dir=str(tmp_path / run)), 1
    if name == "split":
        (tmp_path / run).mkdir()
        store = TierStore(StoreConfig(cpu_bytes="448KiB", nvme_dir=str(tmp_path / run),
                                      nvme_bytes="4MiB", pool_slab_bytes="64KiB"))
        return dict(base, offload_fraction=1.0, state_tier="split", store=store), 1
    if name == "lane":
        return dict(base, offload_fraction=1.0, gpu_step_fraction=1.0), 1
    if name == "lane_half":  # Note [lane rollback on the GPU]: device and host slots
        return dict(base, offload_fraction=1.0, gpu_step_fraction=0.5), 1
    if name == "accumulation":
        return dict(base, grad_accumulation_steps=2), 2
    if name == "forward":
        return dict(base, param_sync="forward"), 1
    raise AssertionError(name)


class _Probe:
    """Records each step's settle result (chunks rolled back, None: no speculation) and lets the
    test wait until the worker has admitted a chunk (so a speculating step really speculates,
    whatever the scheduling)."""

    def __init__(self, monkeypatch) -> None:
        self.results: list[tuple] = []  # (the Speculation, its settle results): in order
        self.admitted = threading.Event()
        settle, admit = speculate.Speculation.settle, speculate.Speculation.admit
        probe = self

        def record(self, *args, **kw):
            out = settle(self, *args, **kw)
            if not probe.results or probe.results[-1][0] is not self:
                probe.results.append((self, []))
            probe.results[-1][1].append(out)
            return out

        def admit_and_tell(self, item):
            ok = admit(self, item)
            if ok:
                probe.admitted.set()
            return ok

        monkeypatch.setattr(speculate.Speculation, "settle", record)
        monkeypatch.setattr(speculate.Speculation, "admit", admit_and_tell)


def _train(kw: dict, accum: int, regime: str, probe: _Probe | None = None,
           expect: set | None = None) -> tuple:
    """Train ``STEPS`` steps; returns (model, optimizer state_dict, the norms seen)."""
    max_norm, scale = REGIMES[regime]
    model = make_models()
    opt = HybridAdam(param_groups(model), **kw, max_grad_norm=max_norm)
    norms = []
    for step in range(STEPS):
        if probe is not None:
            probe.admitted.clear()
        for micro in range(accum):
            idx, tgt = make_batch(step * accum + micro)
            (model(idx, tgt)[1] * scale(step) / accum).backward()
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        norms.append(float(torch.nn.utils.get_total_norm(grads)))
        if probe is not None and step in expect:
            probe.admitted.wait()  # a chunk was stepped before the norm was known
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt.synchronize()
    state = opt.state_dict()
    opt.close()
    return model, state, norms


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int32)  # nan == nan, bit for bit


def refused_step(opt) -> None:
    """``opt.step()`` refused: a non-finite lr set after backward (Note [finite
    hyper-parameters]), checked to raise; the lr put back."""
    lr = opt.param_groups[0]["lr"]
    opt.param_groups[0]["lr"] = float("nan")
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    opt.param_groups[0]["lr"] = lr


def assert_same_bits(a, sa, b, sb) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(_bits(pa), _bits(pb)), name
    for i in sa["state"]:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(_bits(sa["state"][i][key]), _bits(sb["state"][i][key])), (i, key)


CASES = ([(c, r) for c in ("cpu", "nvme", "split", "lane", "lane_half", "accumulation",
                        "forward")
          for r in ("never", "always", "alternate", "nonfinite")] + [("cpu", "burst")])


@pytest.mark.parametrize("config,regime", CASES, ids=[f"{c}-{r}" for c, r in CASES])
def test_speculative_step_is_bit_identical_to_waiting_for_the_norm(config, regime, tmp_path,
                                                                   monkeypatch, one_thread):
    probe = _Probe(monkeypatch)
    active, rolled = DECISIONS[regime]
    kw, accum = _config(config, tmp_path, "spec")
    model, state, norms = _train(dict(kw, rollback_bytes=BUDGET), accum, regime, probe, active)
    ref_kw, _ = _config(config, tmp_path, "ref")
    ref, ref_state, ref_norms = _train(dict(ref_kw, rollback_bytes=0), accum, regime)
    # the premise: the regime's norms
    max_norm = REGIMES[regime][0]
    clipped = {s for s, n in enumerate(ref_norms) if not n <= max_norm - 1e-5}
    assert clipped == {"never": set(), "always": set(range(8)), "alternate": {1, 3, 5, 7},
                       "nonfinite": {2, 7}, "burst": {0, 1, 2, 3}}[regime], ref_norms
    if regime == "nonfinite":
        assert ref_norms[2] == float("inf") and ref_norms[7] != ref_norms[7]
    assert_same_bits(model, state, ref, ref_state)
    results = probe.results[0][1]  # the speculating run's (it runs first)
    assert all(r is None for r in probe.results[1][1])  # the reference never speculates
    assert {s for s, r in enumerate(results) if r is not None} == active, results
    assert {s for s, r in enumerate(results) if r} == rolled, results
    for store in (kw.get("store"), ref_kw.get("store")):
        if store is not None:
            store.close()


def test_stats_count_speculated_and_rolled_back_chunks_and_the_bytes_held(monkeypatch):
    model = make_models()
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                     max_grad_norm=1e-3, rollback_bytes=BUDGET, placement="given")
    chunks = sum(len(g.plan.chunks) for g in opt._groups)
    done = threading.Event()
    original = speculate.Speculation.admit

    def admit(self, item):  # let every chunk be admitted before step() decides
        ok = original(self, item)
        if ok and len(self._admitted) == chunks:
            done.set()
        return ok

    monkeypatch.setattr(speculate.Speculation, "admit", admit)
    model(*make_batch(0))[1].backward()
    done.wait()
    opt.step()
    st = opt.step_stats()
    assert st["speculated_chunks"] == st["rolled_back_chunks"] == chunks
    assert st["chunks"] == 2 * chunks  # each stepped, rolled back and stepped again
    assert st["rollback_held_bytes"] == opt._spec.held_bytes() > 0
    opt.close()


def test_a_small_budget_speculates_on_that_many_chunks_and_the_rest_wait(monkeypatch):
    """Chunks beyond ``rollback_bytes`` wait for the norm: with room for 3 chunks' state, 3 are
    admitted and rolled back, the others stepped once, after the clip; bit-identical."""
    from tiermem.optim.layout import chunk_state_bytes
    ref, model = make_models(), make_models()
    kw = dict(**HP, offload_fraction=1.0, chunk_numel=1024, max_grad_norm=1e-3,
              placement="given")
    slot = chunk_state_bytes(1024, torch.float32)
    opt = HybridAdam(model.parameters(), **kw, rollback_bytes=3 * slot + slot // 2)
    ref_opt = HybridAdam(ref.parameters(), **kw)
    chunks = sum(len(g.plan.chunks) for g in opt._groups)
    for m, o in ((model, opt), (ref, ref_opt)):
        m(*make_batch(0))[1].backward()
        o.step()
    st = opt.step_stats()
    assert len(opt._spec._slots) == 3 and chunks > 3
    assert st["speculated_chunks"] == st["rolled_back_chunks"] <= 3
    assert st["chunks"] == chunks + st["rolled_back_chunks"]
    assert_same_bits(model, opt.state_dict(), ref, ref_opt.state_dict())
    opt.close(), ref_opt.close()


def test_a_rollback_while_the_worker_is_mid_chunk(monkeypatch, one_thread):
    """step() decides to roll back while the worker is inside an admitted chunk's CPU step (it
    blocks there until the decision is taken): step() waits for that chunk, then restores and
    re-steps it; bit-identical to the reference over 8 steps."""
    from tiermem.optim import chunk_worker
    kernel = chunk_worker.adam_step_unchecked
    inside, decided = threading.Event(), threading.Event()
    hold = {"on": False}

    def slow_kernel(*args, **kw):
        if hold["on"] and not decided.is_set():
            inside.set()
            decided.wait()  # mid-chunk: the state is saved, the kernel not yet run
        return kernel(*args, **kw)

    settle = speculate.Speculation.settle

    def settle_late(self, *args, **kw):
        with self._step.lock:
            self._decided = True  # the decision: admission closes
        decided.set()  # ...and the worker goes on with the chunk in hand
        return settle(self, *args, **kw)

    monkeypatch.setattr(chunk_worker, "adam_step_unchecked", slow_kernel)
    monkeypatch.setattr(speculate.Speculation, "settle", settle_late)
    kw = dict(**HP, offload_fraction=1.0, chunk_numel=1024, max_grad_norm=1e-3,
              placement="given")
    model, ref = make_models(), make_models()
    opt = HybridAdam(model.parameters(), **kw, rollback_bytes=BUDGET)
    ref_opt = HybridAdam(ref.parameters(), **kw)
    rolled = []
    for step in range(STEPS):
        for m, o in ((model, opt), (ref, ref_opt)):
            hold["on"] = o is opt and step == 0
            inside.clear(), decided.clear()
            m(*make_batch(step))[1].backward()
            if hold["on"]:
                inside.wait()  # the worker is inside an admitted chunk
            o.step()
            o.zero_grad(set_to_none=True)
            if o is opt:
                rolled.append(o.step_stats()["rolled_back_chunks"])
    assert rolled[0] >= 1
    assert_same_bits(model, opt.state_dict(), ref, ref_opt.state_dict())
    opt.close(), ref_opt.close()


def test_a_rollback_that_forgets_the_moments_is_caught(monkeypatch, tmp_path, one_thread):
    """The slip: restoring only the master (not the moments) must make the bit comparison fail,
    so the comparison can fail where a rollback is incomplete."""
    from tiermem.optim.layout import state_views
    prepare = speculate.Speculation.prepare

    def master_only(self, item, blob):
        with self._step.lock:
            restoring = item in self._restore
            slot = self._admitted.get(item)
        if not restoring or slot is None:
            return prepare(self, item, blob)
        with self._step.lock:
            self._restore.discard(item)
        numel = self._layout.groups[item[0]].plan.chunks[item[1]].numel
        saved = state_views(self._slots[slot][:blob.numel()], numel,
                            self._layout.moments_dtype)[0]
        state_views(blob, numel, self._layout.moments_dtype)[0].copy_(saved)

    monkeypatch.setattr(speculate.Speculation, "prepare", master_only)
    probe = _Probe(monkeypatch)
    kw, accum = _config("cpu", tmp_path, "spec")
    model, state, _ = _train(dict(kw, rollback_bytes=BUDGET), accum, "always", probe, {1})
    ref, ref_state, _ = _train(dict(kw, rollback_bytes=0), accum, "always")
    with pytest.raises(AssertionError):
        assert_same_bits(model, state, ref, ref_state)


def test_the_switch_turns_off_while_steps_keep_clipping_and_on_when_they_stop():
    """Note [speculation switch], on decisions: off once 2 of the last 4 steps clipped, on again
    once at most 1 of the last 4 did."""
    assert (SWITCH_WINDOW, SWITCH_MAX_CLIPPED) == (4, 1)
    switch = SpeculationSwitch()
    outcomes = [True, True, True, False, False, False, True, False, True, False, False, False]
    decisions = []
    for clipped in outcomes:
        decisions.append(switch.on())
        switch.record(clipped)
    assert decisions == [True, True, False, False, False, False, True, True, True, False,
                         False, True]


def test_speculation_is_refused_where_it_is_not_supported(caplog):
    """overlap=False steps every chunk in step(): nothing to speculate (logged); a budget without
    clipping is unused; a bad budget names the field."""
    import logging
    with caplog.at_level(logging.INFO, logger="tiermem"):
        opt = HybridAdam(make_models().parameters(), max_grad_norm=1.0, overlap=False,
                         rollback_bytes="1MiB")
    assert not opt._spec.enabled and "does not speculate" in caplog.text
    opt.close()
    opt = HybridAdam(make_models().parameters(), rollback_bytes="1MiB")
    assert not opt._spec.enabled
    opt.close()
    with pytest.raises(ValueError, match="HybridAdam: rollback_bytes=-1 is negative"):
        HybridAdam(make_models().parameters(), rollback_bytes=-1)
    with pytest.raises(ValueError, match="HybridAdam: rollback_bytes='lots' is not a byte"):
        HybridAdam(make_models().parameters(), rollback_bytes="lots")


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_refused_step_puts_the_speculated_chunks_back(tier, tmp_path, monkeypatch, one_thread):
    """Note [speculative step]: chunks stepped during backward are restored (state and params)
    when step() refuses the step (here a nan lr set after backward: Note [finite
    hyper-parameters]); training then goes on bit-identical to the run that never speculated,
    which had stepped nothing of the refused step."""
    probe = _Probe(monkeypatch)
    runs = []
    for budget in (BUDGET, 0):
        (tmp_path / str(budget)).mkdir()
        model = make_models()
        opt = HybridAdam(param_groups(model), **HP, chunk_numel=1024, offload_fraction=0.5,
                         state_tier=tier, nvme_dir=str(tmp_path / str(budget)),
                         max_grad_norm=1.0, rollback_bytes=budget)
        for step in range(STEPS):
            probe.admitted.clear()
            (model(*make_batch(step))[1] * 1e-2).backward()
            if step == 3:  # refused: a non-finite lr set after backward
                if budget:
                    probe.admitted.wait()  # a chunk was stepped early
                refused_step(opt)
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
        runs.append((model, opt.state_dict()))
        opt.close()
    assert_same_bits(*runs[0], *runs[1])


def test_streamed_weights_speculate(caplog, one_thread):
    """Weight streaming (Note [streamed rollback]): the step speculates, nothing logged as
    refused (exactness: tests/stream/test_stream_speculate.py)."""
    import logging
    from tiermem.stream import stream_weights
    model = make_models()
    store = TierStore(StoreConfig(device="cpu", gpu_bytes=0, cpu_bytes=8 << 20,
                                  pool_slab_bytes=1 << 20))
    stream = stream_weights(model.blocks, store=store)
    with caplog.at_level(logging.INFO, logger="tiermem"):
        opt = HybridAdam(model.parameters(), **HP, chunk_numel=1024, max_grad_norm=1.0,
                         rollback_bytes=BUDGET)
    assert opt._spec.enabled and "does not speculate" not in caplog.text
    opt.close()
    stream.close()
    store.close()


def test_fsdp2_waits_for_the_norm_and_data_parallel_speculates(caplog):
    """FSDP2 assigns every gradient in step(): nothing to speculate on, refused and logged; ZeRO
    data parallel speculates (exactness: tests/distributed/test_dp_speculate.py)."""
    import logging
    from tiermem.optim.step_state import StepState

    class _Layout:  # StateLayout's attribute that Speculation.__init__ sets when enabled
        backward_order = False

    with caplog.at_level(logging.INFO, logger="tiermem"):
        spec = speculate.Speculation(None, StepState(), None, rollback_bytes=BUDGET,
                                     clipping=True, overlap=True, one_process=False,
                                     who="HybridAdam[rank 0]", mode="fsdp")
        assert not spec.enabled and "FSDP2 assigns every gradient" in caplog.text
        caplog.clear()
        layout = _Layout()
        spec = speculate.Speculation(layout, StepState(), None, rollback_bytes=BUDGET,
                                     clipping=True, overlap=True, one_process=False,
                                     who="HybridAdam[rank 0]", mode="zero")
    assert spec.enabled and layout.backward_order and "does not speculate" not in caplog.text


def test_breadth_first_micro_batches_with_forward_sync(monkeypatch, one_thread):
    """Breadth-first micro-batches (Note [breadth-first blocks]) with param_sync="forward", as
    examples/train_large.py runs the 20B RAM preset, in the alternating regime: bit-identical
    to the run that never speculates, with rollbacks at steps 1 and 3."""
    from tiermem.models.gpt import GPT, GPTConfig
    from tiermem.schedule.micro_batches import forward_backward
    probe = _Probe(monkeypatch)
    micro, runs = 3, []
    for budget in (BUDGET, 0):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layers=4, d_model=32, n_heads=4, seq_len=16, vocab=64))
        opt = HybridAdam(param_groups(model), **HP, chunk_numel=1024, offload_fraction=0.74,
                         max_grad_norm=1.0, param_sync="forward", grad_accumulation_steps=micro,
                         rollback_bytes=budget)
        for step in range(STEPS):
            probe.admitted.clear()
            g = torch.Generator().manual_seed(step)
            rows = torch.randint(0, 64, (micro, 2, 17), generator=g)
            scale = 10.0 if step % 2 else 1e-2  # the loss's scale sets the norm: alternating
            batches = [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows]
            hooks = [p.register_hook(lambda grad, s=scale: grad * s)  # before accumulation
                     for p in model.parameters()]
            forward_backward(model, batches, breadth_first_blocks=2)
            for h in hooks:
                h.remove()
            if budget and step in (1, 2, 3):
                probe.admitted.wait()
            opt.step()
            opt.zero_grad(set_to_none=True)
        opt.synchronize()
        runs.append((model, opt.state_dict()))
        opt.close()
    assert_same_bits(*runs[0], *runs[1])
    results = probe.results[0][1]
    assert {s for s, r in enumerate(results) if r is not None} == {1, 2, 3}, results
    assert {s for s, r in enumerate(results) if r} == {1, 3}, results
