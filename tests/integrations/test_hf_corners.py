"""TiermemTrainer's corners against the stock Trainer + torch fused AdamW (Note [trainer
reference] in hf_tiny.py), on the CPU: gradient accumulation 4 over 2 epochs of 17
micro-batches, so every epoch ends with a window of 1 (Note [trainer accumulation]); resume
with ``resume_from_checkpoint=True`` from a checkpoint taken inside the second epoch; clipping
at 1.5 (some steps clip, some do not) with HybridAdam's speculative step (``rollback_bytes``),
with its twin (Trainer's clip left on as well: weights off, or refused), and clipping off;
evaluation during training (``eval_strategy="steps"``) with activation offload and
``param_sync="forward"``. Each is bit-identical to the reference: losses, eval losses and
grad norms at every step, and the final weights. Weight streaming has no trainer
switch (docs/huggingface.md), so it is not covered here."""

from __future__ import annotations

import os
import time

import pytest

from hf_tiny import ClipInGroupOrder, StopAt, dataset, max_diff, tiny_llama, training_args
from transformers import Trainer, TrainerCallback

from tiermem.integrations.hf import TiermemTrainer
from tiermem.optim import HybridAdam

pytestmark = pytest.mark.usefixtures("one_thread")

# 34 samples / batch 2 = 17 micro-batches an epoch: windows 4, 4, 4, 4, 1 (5 steps an epoch)
ACC = dict(gradient_accumulation_steps=4, num_train_epochs=2)
STEPS = 10


class StepStats(TrainerCallback):
    """HybridAdam's per-step stats, summed over the run (``step_stats()`` is the last step's).
    Before a speculating step it waits (up to 5 s) for the worker to admit a first chunk: on a
    busy box the worker may not run before ``step()`` reads the norm, and then nothing is
    speculated (the result is the same; the path under test would not be taken)."""

    def __init__(self):
        self.total: dict[str, float] = {}

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        spec = getattr(getattr(optimizer, "optimizer", optimizer), "_spec", None)
        deadline = time.monotonic() + 5.0
        while (spec is not None and spec.active and not spec._admitted
               and time.monotonic() < deadline):
            time.sleep(0.001)
        return control

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        opt = getattr(optimizer, "optimizer", optimizer)
        if isinstance(opt, HybridAdam):
            for key, value in opt.step_stats().items():
                if isinstance(value, (int, float)):
                    self.total[key] = self.total.get(key, 0) + value
        return control


def train(cls, out: str, *, model=None, resume=None, stop_at=None, evaluate=False,
          trainer_kw=None, **args):
    """``(trainer, logs, evals, weights, stats)``: one ``(step, loss, grad_norm)`` per step,
    one ``(step, eval_loss)`` per evaluation, the final weights, HybridAdam's summed stats."""
    stats = StepStats()
    callbacks = [stats] + ([StopAt(stop_at)] if stop_at else [])
    if evaluate:
        args = dict(args, eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=3)
    model = tiny_llama() if model is None else model
    trainer = cls(model=model, args=training_args(out, **dict(ACC, **args)),
                  train_dataset=dataset(), eval_dataset=dataset(seed=5)[:7] if evaluate else None,
                  callbacks=callbacks, **(trainer_kw or {}))
    trainer.train(resume_from_checkpoint=resume)
    history = trainer.state.log_history
    logs = [(h["step"], h["loss"], h.get("grad_norm")) for h in history if "loss" in h]
    evals = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return trainer, logs, evals, weights, stats.total


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Trainer + fused AdamW, accumulation 4, 2 epochs, clip 1.0 (every step clips)."""
    _, logs, _, weights, _ = train(ClipInGroupOrder, str(tmp_path_factory.mktemp("ref")))
    assert [s for s, _, _ in logs] == list(range(1, STEPS + 1))
    return logs, weights


@pytest.mark.parametrize("opts", [{"offload_fraction": 0.5},
                                  {"offload_fraction": 1.0, "param_sync": "forward"}])
def test_short_last_window_of_each_epoch(reference, tmp_path, opts):
    """Windows 4, 4, 4, 4, 1 per epoch: HybridAdam(grad_accumulation_steps=4) steps where
    Trainer does (after the single micro-batch too) and never mixes an epoch's last window
    into the next epoch's first: 10 steps, every loss and norm and the weights exact."""
    ref_logs, ref_weights = reference
    trainer, logs, _, weights, stats = train(
        TiermemTrainer, str(tmp_path), trainer_kw={"hybrid_adam": dict(opts, chunk_numel=4096)})
    opt = trainer.hybrid_adam
    assert opt.grad_accumulation_steps == 4 and stats["chunks"] > 0
    assert logs == ref_logs
    assert max_diff(weights, ref_weights) == 0.0
    opt.close()


@pytest.mark.parametrize("opts", [{"offload_fraction": 0.5},
                                  {"offload_fraction": 1.0, "param_sync": "forward"}])
def test_resume_latest_checkpoint_inside_the_second_epoch(reference, tmp_path, opts):
    """Checkpoints at steps 7 (two windows into epoch 2) and 14 (never reached); the first run
    stops at 8. A fresh trainer on a differently seeded model with
    ``resume_from_checkpoint=True`` takes checkpoint-7 (the latest), skips the 8 micro-batches
    of epoch 2 already trained, restores HybridAdam's state, the schedule and the step, and
    trains 8-10 exactly as the uninterrupted run (``param_sync="forward"``: the save comes
    while step 7 may still be writing)."""
    ref_logs, ref_weights = reference
    out = str(tmp_path / "out")
    kw = dict(save_strategy="steps", save_steps=7)
    opts = dict(opts, chunk_numel=4096)
    first, logs, _, _, _ = train(TiermemTrainer, out, stop_at=8, trainer_kw={"hybrid_adam": opts},
                                 **kw)
    assert logs == ref_logs[:8]
    assert sorted(os.listdir(out)) == ["checkpoint-7"]
    first.hybrid_adam.close()
    second, logs, _, weights, _ = train(TiermemTrainer, out, model=tiny_llama(seed=7),
                                        resume=True, trainer_kw={"hybrid_adam": opts}, **kw)
    assert second.state.global_step == STEPS
    assert logs == ref_logs  # 1-7 from checkpoint-7's trainer_state.json, 8-10 trained now
    assert max_diff(weights, ref_weights) == 0.0
    second.hybrid_adam.close()


@pytest.mark.parametrize("rollback", [0, "1MiB"])
def test_clip_at_1_5_clips_some_steps_once(tmp_path, rollback):
    """max_grad_norm=1.5: the norms (1.3-3.2) put some steps above it and some below, full
    windows too (steps 6 and 8 clip; the windows of 1, steps 5 and 10, hand their gradients
    over in ``step()``, so little is speculated there), so with ``rollback_bytes`` the
    speculative CPU steps are rolled back on some steps and stand on others; either way the
    clip happens once, in HybridAdam, on the window's gradients."""
    _, ref_logs, _, ref_weights, _ = train(ClipInGroupOrder, str(tmp_path / "ref"),
                                           max_grad_norm=1.5)
    norms = [n for _, _, n in ref_logs]
    assert min(norms) < 1.5 < max(norms[5:9])  # both kinds, full windows too
    opts = {"offload_fraction": 1.0, "chunk_numel": 4096, "rollback_bytes": rollback}
    trainer, logs, _, weights, stats = train(TiermemTrainer, str(tmp_path / "out"),
                                             max_grad_norm=1.5, trainer_kw={"hybrid_adam": opts})
    assert trainer.hybrid_adam.max_grad_norm == 1.5
    if rollback:
        assert stats["speculated_chunks"] > stats["rolled_back_chunks"] > 0
    else:
        assert stats["speculated_chunks"] == 0
    assert logs == ref_logs
    assert max_diff(weights, ref_weights) == 0.0
    trainer.hybrid_adam.close()


class ClipTwice(TiermemTrainer):
    """Slip: Trainer's own clip left on, in addition to HybridAdam's."""

    def _clip_grad_norm(self, model):
        return Trainer._clip_grad_norm(self, model)


@pytest.mark.parametrize("rollback", [0, "1MiB"])
def test_clip_twice_is_caught(tmp_path, rollback):
    """The twin of the test above: Trainer's in-place clip on top of HybridAdam's never passes
    unseen. Chunks that wait for the norm step the twice-clipped gradients (the weights move
    off the reference; always so without ``rollback_bytes``); a chunk the worker speculated
    on before Trainer's clip (with it, timing-dependent) has its gradient copied, and the
    in-place write is refused."""
    _, _, _, ref_weights, _ = train(ClipInGroupOrder, str(tmp_path / "ref"), max_grad_norm=1.5)
    opts = {"offload_fraction": 1.0, "chunk_numel": 4096, "rollback_bytes": rollback}
    try:
        trainer, _, _, weights, _ = train(ClipTwice, str(tmp_path / "out"), max_grad_norm=1.5,
                                          trainer_kw={"hybrid_adam": opts})
    except RuntimeError as exc:
        assert rollback and "gradient was changed after backward" in str(exc)
        return
    assert max_diff(weights, ref_weights) > 0.0
    trainer.hybrid_adam.close()


def test_clip_off_with_accumulation_matches_plain_trainer(tmp_path):
    """max_grad_norm=0 (and ``rollback_bytes`` given: no clip, nothing to speculate): the
    stock Trainer's losses and weights bit for bit; its logged norm is summed in its own
    order (equal to a few ulps, as in test_hf_trainer)."""
    _, ref_logs, _, ref_weights, _ = train(Trainer, str(tmp_path / "ref"), max_grad_norm=0.0)
    opts = {"offload_fraction": 1.0, "chunk_numel": 4096, "rollback_bytes": "1MiB"}
    trainer, logs, _, weights, stats = train(TiermemTrainer, str(tmp_path / "out"),
                                             max_grad_norm=0.0, trainer_kw={"hybrid_adam": opts})
    assert trainer.hybrid_adam.max_grad_norm is None and stats["speculated_chunks"] == 0
    assert [loss for _, loss, _ in logs] == [loss for _, loss, _ in ref_logs]
    assert [n for _, _, n in logs] == pytest.approx([n for _, _, n in ref_logs], rel=1e-6)
    assert max_diff(weights, ref_weights) == 0.0
    trainer.hybrid_adam.close()


def test_evaluation_during_training_with_offload(tmp_path):
    """eval_strategy="steps" every 3 steps and at the end (3, 6, 9, 10) with activation
    offload and HybridAdam with ``param_sync="forward"`` (evaluation's forward must see every
    parameter's last update): every eval loss, every training loss after it and the weights
    are the reference's."""
    _, ref_logs, ref_evals, ref_weights, _ = train(ClipInGroupOrder, str(tmp_path / "ref"),
                                                   evaluate=True)
    assert [s for s, _ in ref_evals] == [3, 6, 9, 10]
    opts = {"offload_fraction": 1.0, "chunk_numel": 4096, "param_sync": "forward"}
    trainer, logs, evals, weights, _ = train(
        TiermemTrainer, str(tmp_path / "out"), evaluate=True,
        trainer_kw={"hybrid_adam": opts, "activation_offload": True})
    assert trainer.activation_offloader.stats()["offloaded"] > 0
    assert evals == ref_evals
    assert logs == ref_logs
    assert max_diff(weights, ref_weights) == 0.0
    trainer.hybrid_adam.close()
