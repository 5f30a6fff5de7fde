"""Note [kept into backward] in the corners a training loop reaches between its steps: an
evaluation under ``no_grad``, an evaluation with autograd on whose outputs are dropped, a
forward that raises in a block (its pass ended, the kept blocks given back), each between
HybridAdam steps over streamed weights (which the optimizer rewrites after each step, so a
kept device copy from an earlier pass would be one step stale). The streamed run must match,
bit for bit, a separately built model trained and evaluated the same way without streaming:
losses, evaluation outputs, weights and optimizer state at every one of 8 steps."""

from __future__ import annotations

import pytest
import torch

from _stream_train import assert_same_steps, batches
from test_stream_hybrid import STEPS, Run, _cfg, stores  # noqa: F401 - the fixture

CASES = {
    "cpu-acc2-clip": _cfg("cpu", "cpu", 1.0, 2, 0.5, False),
    "nvme-split-forward": _cfg("nvme", "split", 0.5, 1, None, False, sync="forward"),
    "cpu-major-ckpt": _cfg("cpu", "cpu", 0.5, 2, 0.5, True, ckpt=True),
    "cpu-lane-prefetch2": _cfg("cpu", "cpu", 1.0, 1, None, False, lane=0.5, prefetch=2),
}


class _Boom(Exception):
    pass


def _between(run: Run, step: int) -> list:
    """The evaluations a loop makes between steps; returns their outputs."""
    model = run.model
    idx, _ = batches(100 + step, 1)[0]
    with torch.no_grad():
        out = [model(idx)[0].clone()]
    logits = model(idx)[0]  # autograd on, outputs dropped: no backward comes
    out.append(logits.detach().clone())
    del logits
    block = model.blocks[len(model.blocks) - 2]  # a kept block raises in its forward

    def boom(module, args):
        raise _Boom

    handle = block.register_forward_pre_hook(boom)
    try:
        with pytest.raises(_Boom):
            model(idx)
    finally:
        handle.remove()
    return out


def _train(cfg, stores, streamed):
    run = Run(cfg, stores, streamed)
    try:
        snaps, evals = [], []
        for s in range(STEPS):
            snaps.append(run.step(s))
            evals.append(_between(run, s))
        return snaps, evals, (run.stream.stats() if run.stream is not None else None)
    finally:
        run.close()


@pytest.mark.parametrize("name", list(CASES))
def test_evaluations_and_a_failed_forward_between_steps_keep_training_exact(stores, one_thread,
                                                                           name):
    cfg = CASES[name]
    want, want_evals, _ = _train(cfg, stores, streamed=False)
    got, got_evals, stats = _train(cfg, stores, streamed=True)
    assert_same_steps(got, want, name)
    for step, (a, b) in enumerate(zip(got_evals, want_evals)):
        for x, y in zip(a, b):
            assert torch.equal(x, y), f"{name} step {step}: an evaluation differs"
    assert stats["fills"] > 0
