"""HybridAdam in an Accelerate loop (issue 31 item 3): TiermemAccelerator's ``prepare``,
``accumulate``, ``clip_grad_norm_`` and ``save_state``/``load_state`` keep a tiny Llama's
training bit-identical to the same loop with the stock Accelerator and torch's fused AdamW over
9 optimizer steps (accumulation 2 with a last window of 1, clipping at 1.0 on every step, linear
warmup, decay / no-decay groups); a checkpoint at step 4 loaded into a fresh loop continues
exactly. The red tests: the stock Accelerator's in-place clip on top of HybridAdam's
(Note [accelerate clipping]) and its state round trip in prepare."""

from __future__ import annotations

import os
import types

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from hf_tiny import dataset, max_diff, tiny_llama
from transformers import get_linear_schedule_with_warmup

from tiermem.integrations.accelerate import TiermemAccelerator, accelerate_refusal
from tiermem.optim import HybridAdam

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 9  # 17 micro-batches of 2: 8 windows of 2 and a last one of 1


def groups(model) -> list[dict]:
    """Decay for matrices, none for the norms (as Trainer builds them)."""
    named = list(model.named_parameters())
    return [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]


def fused_adamw(model, **_):
    return torch.optim.AdamW(groups(model), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)


def hybrid(fraction, tier, spill, clip=1.0):
    def make(model):
        kw = {"nvme_dir": str(spill)} if tier == "nvme" else {}
        if tier == "nvme":
            os.makedirs(spill, exist_ok=True)
        return HybridAdam(groups(model), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                          max_grad_norm=clip, grad_accumulation_steps=2,
                          offload_fraction=fraction, state_tier=tier, chunk_numel=4096, **kw)
    return make


def loop(make_opt, cls=TiermemAccelerator, model=None, clip_params=None, save_at=None,
         save_dir=None, resume=None):
    """Train with ``cls`` and return ``(logs, weights, optimizer)``: ``logs`` one ``(step,
    losses of the window, returned norm)`` per optimizer step."""
    acc = cls(gradient_accumulation_steps=2, cpu=True)
    model = tiny_llama() if model is None else model
    opt = make_opt(model)
    sched = get_linear_schedule_with_warmup(opt, 2, STEPS)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=2)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    step, losses, logs = 0, [], []
    if resume is not None:
        acc.load_state(resume)
        step = 4
        loader = acc.skip_first_batches(loader, 2 * step)
    for batch in loader:
        with acc.accumulate(model):
            loss = model(**batch).loss
            losses.append(loss.item())
            acc.backward(loss)
            norm = None
            if acc.sync_gradients:
                params = model.parameters() if clip_params is None else clip_params(opt)
                norm = acc.clip_grad_norm_(params, 1.0).item()
            opt.step()
            sched.step()
            opt.zero_grad()
        if norm is not None:
            step += 1
            logs.append((step, losses, norm))
            losses = []
            if step == save_at:
                acc.save_state(save_dir)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return logs, weights, unwrap_opt(opt)


def unwrap_opt(opt):
    return opt.optimizer


def group_order(opt):
    """The reference's clip sums the norm in the optimizer's group order (Note [trainer
    reference] in tests/integrations/hf_tiny.py): torch's clip_grad_norm_, unchanged."""
    return [p for g in opt.param_groups for p in g["params"]]


@pytest.fixture(scope="module")
def reference():
    logs, weights, _ = loop(fused_adamw, cls=Accelerator, clip_params=group_order)
    print("reference norms:", [round(n, 3) for _, _, n in logs])
    # every full window clips; the last window of 1 has half a loss (backward divides by 2)
    assert len(logs) == STEPS and all(n > 1.0 for _, _, n in logs[:-1])
    return logs, weights


@pytest.mark.parametrize("fraction,tier", [(0.5, "cpu"), (1.0, "cpu"), (0.5, "nvme"),
                                           (1.0, "nvme")])
def test_accelerate_loop_is_bit_identical_to_fused_adamw(reference, tmp_path, fraction, tier):
    ref_logs, ref_weights = reference
    logs, weights, opt = loop(hybrid(fraction, tier, tmp_path / "spill"))
    assert isinstance(opt, HybridAdam) and opt.chunk_tiers()[tier] > 0
    assert opt.param_groups[0]["lr"] == 0.0  # the linear schedule ran to its end
    assert logs == ref_logs  # every micro-batch's loss and every step's norm
    assert max_diff(weights, ref_weights) == 0.0
    opt.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_save_state_and_load_state_continue_exactly(reference, tmp_path, tier):
    """save_state after step 4; a fresh loop (other initial weights, a new HybridAdam) loads
    it, skips the 8 micro-batches done and trains steps 5-9: the reference's, bit for bit."""
    ref_logs, ref_weights = reference
    ckpt = str(tmp_path / "ckpt")
    logs, weights, opt = loop(hybrid(0.5, tier, tmp_path / "a"), save_at=4, save_dir=ckpt)
    assert logs == ref_logs and max_diff(weights, ref_weights) == 0.0
    saved = torch.load(os.path.join(ckpt, "optimizer.bin"), weights_only=True)
    assert all(int(st["step"]) == 4 for st in saved["state"].values())
    opt.close()
    logs, weights, opt = loop(hybrid(0.5, tier, tmp_path / "b"), model=tiny_llama(seed=7),
                              resume=ckpt)
    assert logs == ref_logs[4:]
    assert max_diff(weights, ref_weights) == 0.0
    opt.close()


def test_prepare_keeps_the_state_where_it_is(monkeypatch):
    """Note [accelerate optimizer wrap]: the stock prepare round-trips state_dict(); ours not."""
    calls = []
    real = HybridAdam.state_dict
    monkeypatch.setattr(HybridAdam, "state_dict", lambda self: calls.append(1) or real(self))
    model = tiny_llama()
    opt = hybrid(1.0, "cpu", None)(model)
    _, wrapped = Accelerator(gradient_accumulation_steps=2, cpu=True).prepare(model, opt)
    assert calls == [1] and wrapped.device_placement is True
    acc = TiermemAccelerator(gradient_accumulation_steps=2, cpu=True)
    _, wrapped = acc.prepare(model, opt)
    assert calls == [1] and wrapped.device_placement is False and wrapped.optimizer is opt
    opt.close()


# ------------------------------------------------------------------ what the comparison catches

def test_stock_accelerator_clip_on_top_of_hybrid_adams_is_caught(reference, tmp_path):
    """The stock Accelerator clips in place before HybridAdam's own clip: silently different;
    with HybridAdam's clip off and the stock one as the only clip, HybridAdam refuses the
    step (it took the gradients in backward)."""
    ref_logs, ref_weights = reference
    logs, weights, opt = loop(hybrid(0.5, "cpu", None), cls=Accelerator)
    assert logs[0][1] == ref_logs[0][1]  # the first window is before any update
    print("clipped twice: weights off by", max_diff(weights, ref_weights))
    assert max_diff(weights, ref_weights) > 0.0
    opt.close()
    with pytest.raises(RuntimeError, match="gradient was changed after backward"):
        loop(hybrid(0.5, "cpu", None, clip=None), cls=Accelerator)


def test_clip_requests_hybrid_adam_cannot_honour_are_refused():
    model = tiny_llama()
    opt = hybrid(0.5, "cpu", None)(model)
    acc = TiermemAccelerator(gradient_accumulation_steps=2, cpu=True)
    model, opt = acc.prepare(model, opt)
    model(**dataset()[0] | {"input_ids": dataset()[0]["input_ids"][None],
                            "labels": dataset()[0]["labels"][None]}).loss.backward()
    with pytest.raises(ValueError, match=r"max_norm=2.0.*build it with max_grad_norm=2.0"):
        acc.clip_grad_norm_(model.parameters(), 2.0)
    with pytest.raises(ValueError, match="max_grad_norm=None"):
        acc.clip_grad_norm_(model.parameters(), float("inf"))
    with pytest.raises(ValueError, match="clip exactly HybridAdam's parameters"):
        acc.clip_grad_norm_(list(model.parameters())[:3], 1.0)
    acc.gradient_state._set_sync_gradients(False)
    with pytest.raises(ValueError, match="off the accumulation boundary"):
        acc.clip_grad_norm_(model.parameters(), 1.0)
    acc.gradient_state._set_sync_gradients(True)
    grads = [p.grad.clone() for p in model.parameters()]
    acc.clip_grad_norm_(model.parameters(), 1.0)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))
    opt.zero_grad()
    unwrap_opt(opt).close()


def test_setups_that_cannot_work_are_refused():
    model = tiny_llama()
    opt = HybridAdam(model.parameters(), lr=1e-2, grad_accumulation_steps=1)
    with pytest.raises(ValueError, match=r"grad_accumulation_steps=1\) but Accelerator\("
                                         r"gradient_accumulation_steps=2\)"):
        TiermemAccelerator(gradient_accumulation_steps=2, cpu=True).prepare(model, opt)
    opt.close()
    ok = types.SimpleNamespace(distributed_type=DistributedType.NO, num_processes=1,
                               mixed_precision="bf16")
    assert accelerate_refusal(ok) is None
    for change, match in [({"distributed_type": DistributedType.DEEPSPEED}, "DeepSpeed plugin"),
                          ({"distributed_type": DistributedType.FSDP}, "FSDP plugin"),
                          ({"num_processes": 2}, "num_processes=2"),
                          ({"mixed_precision": "fp16"}, "GradScaler")]:
        bad = types.SimpleNamespace(**(vars(ok) | change))
        assert match in accelerate_refusal(bad)


@pytest.mark.parametrize("kind,match", [(DistributedType.DEEPSPEED, "DeepSpeed plugin wraps"),
                                        (DistributedType.FSDP, "FSDP plugin shards")])
def test_prepare_refuses_deepspeed_and_fsdp_before_any_plugin(monkeypatch, kind, match):
    """The plugins cannot be had in one CPU process (DeepSpeed is not installed; Accelerate
    takes FSDP only with several GPUs), so the accelerator's state says so as a plugin sets
    it; ``prepare`` refuses before wrapping anything, and the optimizer stays usable."""
    acc = TiermemAccelerator(gradient_accumulation_steps=2, cpu=True)
    model = tiny_llama()
    opt = hybrid(1.0, "cpu", None)(model)
    monkeypatch.setattr(acc.state, "distributed_type", kind)
    with pytest.raises(ValueError, match=f"TiermemAccelerator: Accelerate's {match}"):
        acc.prepare(model, opt)
    assert acc._optimizers == [] and acc._models == []
    monkeypatch.undo()
    model(**next(iter(torch.utils.data.DataLoader(dataset(), batch_size=2)))).loss.backward()
    opt.step()  # a plain loop still trains with it
    opt.close()
