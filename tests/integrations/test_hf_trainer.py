"""HybridAdam through transformers.Trainer (issue 31 item 1): TiermemTrainer trains a tiny
Llama bit-identically to Trainer + torch fused AdamW (Note [trainer reference]) over 9 optimizer
steps with gradient accumulation 2 (and a last window of 1), clipping at 1.0 on every step, a
linear LR schedule with warmup and Trainer's decay / no-decay groups; the logged loss and
grad_norm agree at every step; a checkpoint at step 4 resumed in a new trainer continues
exactly. The red tests show what the comparison catches: Trainer's clip left on in addition to
HybridAdam's (Note [trainer clipping]) and a HybridAdam built the plain way through
``optimizer_cls_and_kwargs``."""

from __future__ import annotations

import os

import pytest
import torch

from hf_tiny import (ClipInGroupOrder, dataset, max_diff, run, tiny_llama,
                     training_args)
from transformers import Trainer

from tiermem.integrations.hf import TiermemTrainer, with_tiermem
from tiermem.optim import HybridAdam

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Trainer + fused AdamW, clip norm in the groups' order (Note [trainer reference])."""
    _, logs, weights = run(ClipInGroupOrder, str(tmp_path_factory.mktemp("ref")))
    return logs, weights


def options(fraction: float, tier: str, tmp_path, param_sync: str = "step") -> dict:
    opts = {"offload_fraction": fraction, "state_tier": tier, "chunk_numel": 4096,
            "param_sync": param_sync}
    if tier == "nvme":
        opts["nvme_dir"] = str(tmp_path / "spill")
        os.makedirs(opts["nvme_dir"])
    return opts


@pytest.mark.parametrize("fraction,tier,sync", [(0.5, "cpu", "step"), (1.0, "cpu", "step"),
                                                (0.5, "nvme", "step"), (1.0, "nvme", "step"),
                                                (1.0, "cpu", "forward")])
def test_trains_bit_identically_to_fused_adamw(reference, tmp_path, fraction, tier, sync):
    ref_logs, ref_weights = reference
    trainer, logs, weights = run(TiermemTrainer, str(tmp_path / "out"),
                                 hybrid_adam=options(fraction, tier, tmp_path, sync))
    opt = trainer.hybrid_adam
    assert isinstance(opt, HybridAdam) and opt.max_grad_norm == 1.0
    assert opt.grad_accumulation_steps == 2 and opt.offload_fraction == fraction
    assert opt.chunk_tiers()[tier] > 0  # state really lives in the tier asked for
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert len(opt.param_groups[1]["params"]) == 5  # 2 x 2 layer norms + the final norm
    assert opt.param_groups[0]["lr"] == 0.0  # the linear schedule drove it to its end
    assert len(logs) == 9 and [s for s, _, _ in logs] == list(range(1, 10))
    assert logs == ref_logs  # every step's loss and grad_norm, exactly
    assert max_diff(weights, ref_weights) == 0.0
    opt.close()


def test_without_clipping_matches_plain_trainer_exactly(tmp_path):
    """max_grad_norm=0: no clip anywhere; the reference is the stock Trainer (and the norm it
    logs is summed in its own order: equal to a few ulps)."""
    _, ref_logs, ref_weights = run(Trainer, str(tmp_path / "ref"), max_grad_norm=0.0)
    trainer, logs, weights = run(TiermemTrainer, str(tmp_path / "out"), max_grad_norm=0.0,
                                 hybrid_adam={"offload_fraction": 1.0})
    assert trainer.hybrid_adam.max_grad_norm is None
    assert [loss for _, loss, _ in logs] == [loss for _, loss, _ in ref_logs]
    assert [n for _, _, n in logs] == pytest.approx([n for _, _, n in ref_logs], rel=1e-6)
    assert max_diff(weights, ref_weights) == 0.0


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_resume_from_checkpoint_continues_exactly(reference, tmp_path, tier):
    """Stop at step 4 (Trainer's checkpoint: model, optimizer.pt, scheduler, RNG), resume in a
    new trainer with a differently initialised model: steps 5-9 and the final weights equal
    the uninterrupted run's."""
    ref_logs, ref_weights = reference
    out = str(tmp_path / "out")
    first, logs, _ = run(TiermemTrainer, out, save_strategy="steps", save_steps=4, stop_at=4,
                         hybrid_adam=options(0.5, tier, tmp_path))
    assert logs == ref_logs[:4]
    ckpt = os.path.join(out, "checkpoint-4")
    saved = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True)
    tensors = [t for st in saved["state"].values() for t in st.values()]
    assert len(saved["state"]) == sum(1 for _ in first.model.parameters())
    assert all(t.device.type == "cpu" for t in tensors)
    assert all(int(st["step"]) == 4 for st in saved["state"].values())
    first.hybrid_adam.close()
    second, logs, weights = run(TiermemTrainer, out, model=tiny_llama(seed=7), resume=ckpt,
                                save_strategy="steps", save_steps=4,
                                hybrid_adam=options(0.5, tier, tmp_path / "again"))
    assert logs == ref_logs  # 1-4 from the checkpoint's trainer_state.json, 5-9 trained now
    assert max_diff(weights, ref_weights) == 0.0
    second.hybrid_adam.close()


def test_resume_in_the_same_trainer_after_training_on(reference, tmp_path):
    """The same trainer trains to the end, then resumes from step 4: Trainer loads the
    checkpoint's weights into the model while HybridAdam's state exists (issue 27 item 1,
    Note [param changes]), then its optimizer state; steps 5-9 again equal the reference."""
    ref_logs, ref_weights = reference
    out = str(tmp_path / "out")
    trainer, logs, _ = run(TiermemTrainer, out, save_strategy="steps", save_steps=4,
                           hybrid_adam={"offload_fraction": 0.5})
    assert logs == ref_logs
    trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-4"))
    again = [(h["step"], h["loss"], h.get("grad_norm")) for h in trainer.state.log_history
             if "loss" in h]
    assert again == ref_logs  # 1-4 from the checkpoint, 5-9 trained again
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    assert max_diff(weights, ref_weights) == 0.0


def test_prepare_keeps_the_state_where_it_is(tmp_path, monkeypatch):
    """Note [trainer optimizer wrap]: Accelerate's wrapper would call state_dict() and
    load_state_dict() in prepare (the whole state through the GPU); the trainer's does not."""
    calls = []
    real = HybridAdam.state_dict
    monkeypatch.setattr(HybridAdam, "state_dict", lambda self: calls.append(1) or real(self))
    trainer, _, _ = run(TiermemTrainer, str(tmp_path), max_steps=2,
                        hybrid_adam={"offload_fraction": 1.0})
    assert calls == []
    assert trainer.optimizer.device_placement is False
    assert trainer.optimizer.optimizer is trainer.hybrid_adam


# ------------------------------------------------------------------ what the comparison catches

class ClipTwice(TiermemTrainer):
    """Slip: Trainer's own clip left on, in addition to HybridAdam's."""

    def _clip_grad_norm(self, model):
        return Trainer._clip_grad_norm(self, model)


def test_trainer_clip_on_top_of_hybrid_adams_is_caught(reference, tmp_path):
    ref_logs, ref_weights = reference
    _, logs, weights = run(ClipTwice, str(tmp_path), hybrid_adam={"offload_fraction": 0.5})
    assert logs[0][1] == ref_logs[0][1]  # the first loss is before any update
    # the second clip scales by 1 / (1 + ~1e-6): too little to move a float32 loss of this
    # tiny model in 9 steps, but every clipped weight differs
    print("clipped twice: weights off by", max_diff(weights, ref_weights))
    assert max_diff(weights, ref_weights) > 0.0


def test_plain_optimizer_cls_and_kwargs_breaks(reference, tmp_path):
    """Why a trainer subclass: HybridAdam through the stock Trainer's optimizer_cls_and_kwargs.
    With clipping in both it clips twice (silently different); with Trainer's clip off, Trainer
    still asks accelerate for the norm, and an accelerate that multiplies every gradient by 1.0
    in place there, after backward copied them off, has the step refused (HybridAdam); one
    that takes the norm alone (accelerate 1.16) trains as the stock Trainer with fused AdamW."""
    ref_logs, ref_weights = reference
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=1.0,
              grad_accumulation_steps=2, offload_fraction=0.5)

    def stock(out, **args):
        clip = args.get("max_grad_norm", 1.0) or None
        return Trainer(model=tiny_llama(), args=training_args(out, **args),
                       train_dataset=dataset(),
                       optimizer_cls_and_kwargs=(HybridAdam, dict(kw, max_grad_norm=clip)))

    trainer = stock(str(tmp_path / "a"))
    trainer.train()
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    assert max_diff(weights, ref_weights) > 0.0
    if _clip_at_inf_writes_grads():
        with pytest.raises(RuntimeError, match="gradient was changed after backward"):
            stock(str(tmp_path / "b"), max_grad_norm=0.0).train()
    else:  # this accelerate takes the norm without writing: the stock Trainer trains exactly
        trainer = stock(str(tmp_path / "b"), max_grad_norm=0.0)
        trainer.train()
        _, _, plain = run(Trainer, str(tmp_path / "ref"), max_grad_norm=0.0)
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        assert max_diff(weights, plain) == 0.0


def _clip_at_inf_writes_grads() -> bool:
    """Whether Trainer's norm-only call (``accelerator.clip_grad_norm_(params, inf)``, made when
    its own clip is off) multiplies every gradient by 1.0 in place: torch's clip_grad_norm_
    does, and so did accelerate until it took the norm alone at ``max_norm=inf``
    (``Accelerator._clip_grad_norm_dtensor_aware``; accelerate 1.16 has it)."""
    from accelerate import Accelerator
    clip = getattr(Accelerator, "_clip_grad_norm_dtensor_aware", None)
    if clip is None:
        return True
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    version = p.grad._version
    clip(None, [p], float("inf"))  # it reads nothing of the accelerator itself
    return p.grad._version != version


def test_a_hybrid_adam_that_accumulates_differently_is_refused(tmp_path):
    model = tiny_llama()
    opt = HybridAdam(model.parameters(), lr=1e-2, max_grad_norm=1.0, grad_accumulation_steps=1)
    with pytest.raises(ValueError, match="grad_accumulation_steps=2"):
        run(TiermemTrainer, str(tmp_path), model=model, optimizers=(opt, None))
    opt.close()


def test_with_tiermem_mixes_into_a_trainer_subclass(reference, tmp_path):
    """A Trainer subclass (as TRL's SFTTrainer is) gets the same behaviour."""
    class Custom(Trainer):
        pass
    cls = with_tiermem(Custom)
    assert cls.__name__ == "TiermemCustom" and with_tiermem(cls) is cls
    _, logs, weights = run(cls, str(tmp_path), hybrid_adam={"offload_fraction": 1.0})
    assert logs == reference[0] and max_diff(weights, reference[1]) == 0.0
    with pytest.raises(TypeError, match="trainer_cls must be transformers.Trainer"):
        with_tiermem(torch.nn.Module)
