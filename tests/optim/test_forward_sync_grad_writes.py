"""Note [gradient writes after a forward-synced step] (tiermem/optim/grad_reads.py): an
in-place write to ``p.grad`` after a ``param_sync="forward"`` ``step()`` returned, while the
worker still reads gradients (``model.zero_grad(set_to_none=False)``, ``p.grad.zero_()``,
``p.grad.mul_()``, a write through ``p.grad.data``), is refused in one line when the step
completes (the old code stepped the changed values silently: 8 steps differed from
torch.optim.AdamW from the second on); ``set_to_none=True``, ``opt.zero_grad(set_to_none=False)``
and a write after every read stay bit-identical to AdamW at every step. And the refusal of an
extra backward pass says whether chunks stepped during backward stay stepped."""

from __future__ import annotations

import time

import pytest
import torch

from tiermem.optim import HybridAdam
from tiermem.optim import chunk_worker
from tiermem.stream.checksums import checksum

STEPS = 8


@pytest.fixture
def slow_worker(monkeypatch):
    """Each CPU Adam call sleeps 5 ms first: the worker still reads gradients when ``step()``
    returns (a large model's step), deterministically."""
    original = chunk_worker.adam_step_unchecked

    def slow(*args, **kwargs):
        time.sleep(0.005)
        return original(*args, **kwargs)

    monkeypatch.setattr(chunk_worker, "adam_step_unchecked", slow)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])


def _batch(step: int) -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(step))


def _write(model: torch.nn.Module, how: str) -> None:
    """The loop's gradient reset or write right after ``step()``."""
    if how == "model_zero":
        model.zero_grad(set_to_none=False)
    elif how == "model_none":
        model.zero_grad()  # set_to_none=True, torch's default
    else:
        for p in model.parameters():
            if how == "grad_zero":
                p.grad.zero_()
            elif how == "grad_mul":
                p.grad.mul_(0.5)
            elif how == "grad_data":
                p.grad.data.zero_()  # moves no version counter


def _train(model, opt, after_step, steps: int = STEPS) -> list[float]:
    """``steps`` steps; ``after_step(opt)`` right after each ``step()``; the losses."""
    losses = []
    for step in range(steps):
        loss = model(_batch(step)).square().mean()
        losses.append(loss.item())
        loss.backward()
        opt.step()
        after_step(opt)
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    return losses


def _reference() -> tuple[list[float], list[torch.Tensor]]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    losses = _train(model, opt, lambda o: model.zero_grad(set_to_none=False))
    return losses, [p.detach().clone() for p in model.parameters()]


def _hybrid(model, fraction: float, **kw) -> HybridAdam:
    return HybridAdam(model.parameters(), lr=1e-3, offload_fraction=fraction, chunk_numel=1024,
                      param_sync="forward", **kw)


def _assert_as_reference(model, losses) -> None:
    ref_losses, ref_params = _reference()
    assert losses == ref_losses  # bit for bit, at every step
    for got, want in zip(model.parameters(), ref_params):
        assert torch.equal(got.detach(), want)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("how", ["model_zero", "grad_zero", "grad_mul", "grad_data"])
def test_in_place_gradient_write_after_step_is_refused(slow_worker, fraction, how):
    """Red on the old code (DID NOT RAISE: the worker stepped the written gradients)."""
    model = _model()
    opt = _hybrid(model, fraction)
    model(_batch(0)).square().mean().backward()
    opt.step()
    with opt._step.lock:
        pending = len(opt._step.chunk_missing) - len(opt._step.chunk_h2d)
    assert pending >= 3  # the worker still reads when the loop writes (13 or 25 chunks)
    _write(model, how)
    with pytest.raises(RuntimeError, match=r"written in place after step\(\) returned "
                       r"\(param_sync='forward'\).*restart from a checkpoint.*"
                       r"set_to_none=True.*opt\.synchronize\(\)"):
        model(_batch(1))  # the forward completes the step
    # the step was completed and counted: the optimizer trains on
    opt.zero_grad()
    _train(model, opt, lambda o: o.zero_grad(), steps=2)
    opt.close()


@pytest.mark.parametrize("config", [dict(gpu_step_fraction=0.5),
                                    dict(max_grad_norm=1e-3),
                                    dict(max_grad_norm=1e-3, rollback_bytes="1MiB")])
def test_refused_on_the_lane_and_with_clipping(slow_worker, config):
    """The GPU lane's reads (on the CPU: the lane's copy of the gradients) and chunks shipped
    in ``step()`` after the clip are watched too."""
    model = _model()
    opt = _hybrid(model, 1.0, **config)
    for step in range(2):  # the second step also speculates (state exists)
        model(_batch(step)).square().mean().backward()
        opt.step()
        if step == 0:
            opt.zero_grad()
    _write(model, "model_zero")
    with pytest.raises(RuntimeError, match="written in place after step"):
        opt.synchronize()
    opt.close()


@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("reset", ["model_none", "opt_zero"])
def test_resets_that_keep_the_worker_s_gradients_are_exact(slow_worker, fraction, reset):
    """Must pass: ``model.zero_grad()`` (set_to_none=True) drops ``p.grad`` (the worker keeps
    its own reference); ``opt.zero_grad(set_to_none=False)`` completes the step first."""
    model = _model()
    opt = _hybrid(model, fraction)
    if reset == "model_none":
        losses = _train(model, opt, lambda o: _write(model, "model_none"))
    else:
        losses = _train(model, opt, lambda o: o.zero_grad(set_to_none=False))
    _assert_as_reference(model, losses)
    opt.close()


def _wait_for_every_chunk(opt: HybridAdam) -> None:
    """Until the worker has stepped every chunk (read every gradient), without completing."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with opt._step.lock:
            if len(opt._step.chunk_h2d) == len(opt._step.chunk_missing):
                return
        time.sleep(0.001)
    raise AssertionError("the worker did not finish")


@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("how", ["model_zero", "grad_data"])
def test_a_write_after_every_read_is_exact(slow_worker, fraction, how):
    """Must pass: the write comes after the worker read every gradient but before the step
    completes (the next forward): the step read what backward left, bit for bit AdamW's (a
    check of versions or bytes at the completion alone would refuse it)."""
    model = _model()
    opt = _hybrid(model, fraction)

    def late_write(o):
        _wait_for_every_chunk(o)
        _write(model, how)

    losses = _train(model, opt, late_write)
    _assert_as_reference(model, losses)
    opt.close()


def test_the_twin_comparing_at_the_completion_refuses_the_exact_write(slow_worker, monkeypatch):
    """Must go red: summed at the completion instead of behind each read, the pieces see the
    write that came after every read, and the exact step above is refused."""
    from tiermem.optim.grad_reads import ReadGuard  # here: the old code has no such module

    def lazy_sum_after(self, g, c, pieces, stream):
        for param, t in pieces:
            self._after[(g, c, param)] = (t, None)  # the piece itself, summed in verdict()

    verdict = ReadGuard.verdict

    def late_verdict(self, side):
        with self._lock:
            self._after = {k: (checksum(t), ev) for k, (t, ev) in self._after.items()}
        return verdict(self, side)

    monkeypatch.setattr(ReadGuard, "_sum_after", lazy_sum_after)
    monkeypatch.setattr(ReadGuard, "verdict", late_verdict)
    model = _model()
    opt = _hybrid(model, 1.0)
    model(_batch(0)).square().mean().backward()
    opt.step()
    _wait_for_every_chunk(opt)
    _write(model, "model_zero")
    with pytest.raises(RuntimeError, match="written in place after step"):
        model(_batch(1))
    opt.close()


@pytest.mark.parametrize("config", [dict(gpu_step_fraction=0.5),
                                    dict(max_grad_norm=1e-3, rollback_bytes="1MiB")])
def test_untouched_gradients_step_as_param_sync_step(slow_worker, config):
    """Must pass: the sums change nothing; the lane and a clipping, speculating optimizer with
    ``param_sync="forward"`` step bit for bit as with ``param_sync="step"``."""
    runs = []
    for sync in ("forward", "step"):
        model = _model()
        opt = HybridAdam(model.parameters(), lr=1e-3, offload_fraction=1.0, chunk_numel=1024,
                         param_sync=sync, **config)
        losses = _train(model, opt, lambda o: o.zero_grad())
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
        opt.close()
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- check_accumulation's message


def _extra_pass(opt: HybridAdam, model) -> str:
    """Two backward passes with ``grad_accumulation_steps=1``; the refusal's message."""
    model(_batch(0)).square().mean().backward()
    opt._step.drain()  # the chunks stepped in backward are written before the next forward
    model(_batch(1)).square().mean().backward()
    with pytest.raises(RuntimeError, match="2 backward passes accumulated") as info:
        opt.step()
    return str(info.value)


def test_extra_pass_after_chunks_stepped_says_they_stay_stepped():
    model = _model()
    opt = HybridAdam(model.parameters(), lr=1e-3, offload_fraction=1.0, chunk_numel=1024)
    model(_batch(0)).square().mean().backward()  # a first step: the state exists
    opt.step()
    opt.zero_grad()
    message = _extra_pass(opt, model)
    assert "offloaded chunks were already stepped during backward" in message
    assert "stay stepped: restart from a checkpoint" in message
    opt.zero_grad()
    _train(model, opt, lambda o: o.zero_grad(), steps=2)  # usable after the refusal
    opt.close()


@pytest.mark.parametrize("config", [dict(overlap=False), dict(max_grad_norm=1.0),
                                    dict(max_grad_norm=1.0, rollback_bytes="1MiB")])
def test_extra_pass_with_nothing_stepped_says_nothing_was_applied(config):
    """Nothing stepped during backward (no overlap, held for the clip) or speculated and put
    back: the message must not send the user to a checkpoint."""
    model = _model()
    opt = HybridAdam(model.parameters(), lr=1e-3, offload_fraction=1.0, chunk_numel=1024,
                     **config)
    model(_batch(0)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    state = opt.state_dict()
    message = _extra_pass(opt, model)
    assert "Nothing of this step was applied" in message
    assert "restart from a checkpoint" not in message
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    after = opt.state_dict()
    for sid, st in state["state"].items():
        for name, value in st.items():
            assert torch.equal(after["state"][sid][name], value), (sid, name)
    opt.close()
