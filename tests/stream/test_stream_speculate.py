"""Note [streamed rollback]: HybridAdam's speculative step (Note [speculative step]) over streamed
weights, whose updated values go into the store's host copies the next pass streams. The
reference is an independent run with the same arguments and ``rollback_bytes=0`` (every chunk
waits for the norm), also streamed: weights, moments and step counts must be bit-identical after
every one of 8 steps, for the cpu and nvme stream tiers, ``offload_fraction`` 1 and 0.5,
accumulation, depth-first and block-major, in the four regimes of tests/optim/test_speculate.py
(never clipped, always, alternating, an inf and a nan norm), with its decisions (which steps
speculate and roll back) asserted; a refused step puts the host copies back.
"""

from __future__ import annotations

import pytest
import torch

from optim.test_speculate import DECISIONS, REGIMES, _bits, _Probe, refused_step
from tiermem.optim.hybrid_adam import HybridAdam
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights

from _stream_train import batches, make_model

STEPS = 8
BUDGET = 1 << 30  # every chunk fits

# name -> (stream tier, offload_fraction, micro-batches, block-major, state tier)
CONFIGS = {
    "cpu-f1": ("cpu", 1.0, 1, False, "cpu"),
    "cpu-f05-acc2-major": ("cpu", 0.5, 2, True, "cpu"),
    "nvme-f1-acc2-major": ("nvme", 1.0, 2, True, "cpu"),
    "nvme-f05-acc2-nvmestate": ("nvme", 0.5, 2, False, "nvme"),
}


@pytest.fixture
def stores(make_stream_store):
    """``stores(nvme, device="cpu")``: a store, 8 MiB RAM, no GPU budget on the CPU (1 MiB on
    CUDA); ``nvme``: a 64 MiB NVMe tier."""
    return lambda nvme, device="cpu": make_stream_store(
        device=device, gpu_bytes=0 if device == "cpu" else 1 << 20, cpu_bytes=8 << 20,
        **({"nvme_bytes": 64 << 20} if nvme else {}))


def _scaled(model, scale):
    """``model.output`` with its loss multiplied by ``scale[0]`` (the scale sets the norm)."""
    output = model.output

    def out(x, targets=None):
        logits, loss = output(x, targets)
        return logits, loss * scale[0]
    model.output = out


def _snapshot(model, opt) -> tuple[dict, dict]:
    weights = {k: _bits(v).clone() for k, v in model.state_dict().items()}
    sd = opt.state_dict()
    state = {(i, k): _bits(t.float()).clone() for i, st in sd["state"].items()
             for k, t in st.items() if isinstance(t, torch.Tensor)}
    return weights, state


def _train(name: str, regime: str, stores, budget: int, probe: _Probe | None = None,
           expect: set = frozenset(), refuse: int | None = None,
           device: str = "cpu") -> tuple[list, list]:
    """8 steps of config ``name`` in ``regime`` on ``device``; returns each step's snapshot
    and norm. ``refuse``: the step whose ``step()`` is refused (a nan lr set after backward)."""
    tier, fraction, n_micro, major, state_tier = CONFIGS[name]
    max_norm, scale_of = REGIMES[regime]
    model = make_model().to(device)
    scale = [1.0]
    _scaled(model, scale)
    store = stores(tier == "nvme", device)
    stream = stream_weights(model.blocks, store=store, tier=tier)
    opt = HybridAdam(model.parameters(), lr=3e-3, weight_decay=0.1, offload_fraction=fraction,
                     chunk_numel=2048, max_grad_norm=max_norm, grad_accumulation_steps=n_micro,
                     state_tier=state_tier,
                     store=stores(True, device) if state_tier != "cpu" else None,
                     rollback_bytes=budget)
    assert opt._spec.enabled == bool(budget)  # Note [streamed rollback]: it speculates
    snaps, norms = [], []
    try:
        for step in range(STEPS):
            scale[0] = scale_of(step)
            if probe is not None:
                probe.admitted.clear()
            mbs = [(i.to(device), t.to(device)) for i, t in batches(step, n_micro)]
            forward_backward(model, mbs, block_major=major)
            grads = [p.grad for p in model.parameters() if p.grad is not None]  # host ones too
            norms.append(float(torch.nn.utils.get_total_norm(grads)))
            if probe is not None and step in expect:
                probe.admitted.wait()  # a chunk was stepped before the norm was known
            if step == refuse:
                refused_step(opt)
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
            opt.synchronize()
            snaps.append(_snapshot(model, opt))
    finally:
        opt.close()
        stream.close()
    return snaps, norms


def _same(got: list, want: list, what: str) -> None:
    assert len(got) == len(want) == STEPS
    for step, ((wa, sa), (wb, sb)) in enumerate(zip(got, want)):
        for k in wb:
            assert torch.equal(wa[k], wb[k]), f"{what} step {step}: weight {k} differs"
        assert sa.keys() == sb.keys()
        for k in sb:
            assert torch.equal(sa[k], sb[k]), f"{what} step {step}: state {k} differs"


CASES = [(c, r) for c in CONFIGS for r in ("never", "always", "alternate", "nonfinite")]


@pytest.mark.parametrize("name,regime", CASES, ids=[f"{c}-{r}" for c, r in CASES])
def test_streamed_speculation_is_bit_identical_to_waiting_for_the_norm(
        name, regime, stores, monkeypatch, one_thread):
    probe = _Probe(monkeypatch)
    active, rolled = DECISIONS[regime]
    got, norms = _train(name, regime, stores, BUDGET, probe, active)
    want, ref_norms = _train(name, regime, stores, 0)
    max_norm = REGIMES[regime][0]
    clipped = {s for s, n in enumerate(ref_norms) if not n <= max_norm - 1e-5}
    assert clipped == {"never": set(), "always": set(range(8)), "alternate": {1, 3, 5, 7},
                       "nonfinite": {2, 7}}[regime], ref_norms  # the premise
    if regime == "nonfinite":
        assert ref_norms[2] == float("inf") and ref_norms[7] != ref_norms[7]
    _same(got, want, f"{name}-{regime}")
    moved = [k for k in want[0][0] if k.startswith("blocks.")
             and not torch.equal(want[0][0][k], want[-2][0][k])]
    assert moved, "the streamed weights moved"
    results = probe.results[0][1]  # the speculating run's (it runs first)
    assert all(r is None for r in probe.results[1][1])  # the reference never speculates
    assert {s for s, r in enumerate(results) if r is not None} == active, results
    assert {s for s, r in enumerate(results) if r} == rolled, results


@pytest.mark.parametrize("name", ["cpu-f1", "nvme-f1-acc2-major"])
def test_a_refused_step_puts_the_streamed_host_copies_back(name, stores, monkeypatch,
                                                           one_thread):
    """Note [streamed rollback]: the chunks stepped during backward wrote the host copies;
    step() refuses (a nan lr) and undo() writes the restored masters back into them; the next
    passes stream them (``tier="nvme"``: from the NVMe copy, which nothing rewrote):
    bit-identical to the run that never speculated, which wrote nothing of the refused step."""
    probe = _Probe(monkeypatch)
    got, _ = _train(name, "never", stores, BUDGET, probe, {3}, refuse=3)
    want, _ = _train(name, "never", stores, 0, refuse=3)
    _same(got, want, name)
    for k in want[2][0]:
        assert torch.equal(got[3][0][k], got[2][0][k]), f"the refused step changed weight {k}"


def test_a_rollback_that_leaves_the_host_copy_stale_is_caught(stores, monkeypatch, one_thread):
    """The comparison sees the host copies: a rolled-back chunk whose second step does not
    reach them (its weights put back as the speculative step left them, unclipped) fails it."""
    from tiermem.optim import chunk_worker
    from tiermem.optim.layout import local_view
    step_chunk = chunk_worker.ChunkWorker._step_chunk

    def restep_loses_the_weights(self, g, c, copies):
        if not self._step.is_restep((g, c)):
            return step_chunk(self, g, c, copies)
        group = self._layout.groups[g]
        pieces = [pc for pc in group.plan.chunks[c].pieces if pc.param in group.host_copies]
        kept = [local_view(group, pc.param).clone() for pc in pieces]
        step_chunk(self, g, c, copies)
        for pc, old in zip(pieces, kept):
            local_view(group, pc.param).copy_(old)

    monkeypatch.setattr(chunk_worker.ChunkWorker, "_step_chunk", restep_loses_the_weights)
    probe = _Probe(monkeypatch)
    got, _ = _train("cpu-f1", "always", stores, BUDGET, probe, {1})
    want, _ = _train("cpu-f1", "always", stores, 0)
    assert probe.results[0][1][1] > 0  # step 1 rolled back
    with pytest.raises(AssertionError, match="step 1: weight blocks"):
        _same(got, want, "stale")
