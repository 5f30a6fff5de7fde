"""Streamed weights with HybridAdam combined the way users combine them (issue 29): activation
offload + checkpointing + an NVMe weight tier + an NVMe state tier + accumulation + clipping
(depth-first and block-major); LoRA with a streamed frozen base; parameters changed between
steps (``fill_``, ``load_state_dict``, ``p.data = t``; Note [param changes]: taken or refused,
never silently undone); ``zero_grad(set_to_none=False)``; an evaluation under ``no_grad``
between steps with ``param_sync="forward"``; a forward that raises; a checkpoint through
``tiermem.checkpoint`` at tier nvme; ``stream.close()`` while HybridAdam steps it (refused) and
training continued unstreamed after it. Every training run is 8 HybridAdam steps of different
batches compared bit for bit, at every step and in the final weights, with an independent
unstreamed HybridAdam run of a model built from the same seed."""

from __future__ import annotations

import pytest
import torch
from _stream_train import assert_same_run, batches, make_model
from test_compose import lora_model

from tiermem.checkpoint import load_checkpoint, save_checkpoint
from tiermem.offload import offload_activations
from tiermem.optim.hybrid_adam import HybridAdam
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster
STEPS = 8


@pytest.fixture
def stores(make_stream_store):
    """``stores()``: a CPU store, no GPU budget, 16 MiB RAM, a 64 MiB NVMe tier."""
    return lambda: make_stream_store(gpu_bytes=0, nvme_bytes=64 << 20)


class Run:
    """A GPT (or LoRA GPT) trained by HybridAdam; ``streamed``: its blocks' weights streamed
    (the stream built before HybridAdam), ``offload``: activation offload of blocks 0-2."""

    def __init__(self, stores, streamed, *, tier="nvme", state_tier="nvme", n_micro=2,
                 clip=0.5, major=False, ckpt=False, offload=False, sync="step", lora=None,
                 seed=0):
        self.model = (lora_model(ckpt) if lora is not None
                      else make_model(checkpoint=ckpt, seed=seed))
        self.n_micro, self.major = n_micro, major
        self.stream = stream_weights(self.model.blocks, store=stores(), tier=tier,
                                     prefetch_blocks=1, frozen_only=bool(lora)) \
            if streamed else None
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = HybridAdam(params, lr=3e-3, weight_decay=0.1, offload_fraction=1.0,
                              chunk_numel=2048, max_grad_norm=clip,
                              grad_accumulation_steps=n_micro, state_tier=state_tier,
                              store=stores() if state_tier != "cpu" else None,
                              param_sync=sync)
        self.off = offload_activations(self.model.blocks, store=stores(), tier="cpu",
                                       layers=[0, 1, 2], min_offload_bytes=0) \
            if offload else None
        self.losses = []

    def step(self, step, set_to_none=True):
        mb = batches(step, self.n_micro)
        if self.off is not None:
            with self.off:
                losses = forward_backward(self.model, mb, block_major=self.major)
        else:
            losses = forward_backward(self.model, mb, block_major=self.major)
        self.opt.step()
        self.opt.zero_grad(set_to_none=set_to_none)
        self.losses.append(torch.stack(losses).detach())

    def result(self):
        self.opt.synchronize()
        return self.losses, {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def close(self):
        self.opt.close()
        if self.stream is not None:
            self.stream.close()
        if self.off is not None:
            self.off.close()


def _train(stores, streamed, between=None, steps=range(STEPS), **kw):
    run = Run(stores, streamed, **kw)
    try:
        for s in steps:
            if between is not None:
                between(run, s)
            run.step(s)
        return run.result()
    finally:
        run.close()


@pytest.mark.parametrize("major", [False, True], ids=["depth-first", "block-major"])
def test_everything_at_once_is_bit_identical(stores, major):
    """Activation offload + checkpointing + weights on NVMe + state on NVMe + 2 micro-batches +
    clipping, against the same HybridAdam run with nothing streamed or offloaded."""
    want = _train(stores, False, major=major, ckpt=True)
    got = _train(stores, True, major=major, ckpt=True, offload=True)
    assert_same_run(got, want, "combined")
    assert not torch.equal(want[1]["blocks.0.qkv.weight"],
                           make_model().state_dict()["blocks.0.qkv.weight"])  # trained


def _replace_data(run, step):
    if step == 3:
        p = run.model.blocks[1].qkv.weight
        p.data = torch.full_like(p.data, 0.02)


def _in_place(run, step):
    p = run.model.blocks[2].fc.weight
    if step == 2:
        run.saved = {k: v.clone() for k, v in run.model.state_dict().items()}
    with torch.no_grad():
        if step == 3:
            p.fill_(0.01)
        if step == 5:
            run.model.load_state_dict(run.saved)  # back to the best weights


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("change", [_replace_data, _in_place], ids=["data=", "fill-load"])
def test_parameter_changes_between_steps_are_taken(stores, tier, change):
    """Note [param changes]: before, ``p.data = t`` on a streamed weight was copied into the
    host copy at the next pass start without moving the parameter's version, so HybridAdam
    stepped its old master and wrote it back: ``t`` was streamed for one step and then silently
    undone (the losses from step 4 on differed)."""
    want = _train(stores, False, between=change, tier=tier, state_tier="cpu")
    got = _train(stores, True, between=change, tier=tier, state_tier="cpu")
    assert_same_run(got, want, change.__name__)


@pytest.mark.parametrize("clip", [None, 0.5], ids=["overlap", "clip"])
def test_data_replaced_between_backward_and_step(stores, clip):
    """``p.data = t`` after the backward, before ``step()``: with overlap (no clipping) the
    chunk was stepped from the old value during the backward, so ``step()`` refuses, as it does
    unstreamed; with clipping the step takes ``t`` and steps it. Before, a streamed weight's
    replacement was not seen by HybridAdam: no refusal with overlap, and with clipping the step
    was thrown away at the next pass, which streamed ``t`` unstepped."""
    def run(streamed):
        r = Run(stores, streamed, tier="cpu", state_tier="cpu", n_micro=1, clip=clip)
        try:
            for s in range(STEPS):
                r.losses.append(torch.stack(forward_backward(r.model, batches(s, 1))).detach())
                if s == 2:
                    p = r.model.blocks[1].qkv.weight
                    p.data = torch.full_like(p.data, 0.02)
                r.opt.step()
                r.opt.zero_grad()
            return r.result()
        finally:
            r.close()

    if clip is None:
        for streamed in (False, True):
            with pytest.raises(RuntimeError, match="changed after backward had handed it"):
                run(streamed)
    else:
        assert_same_run(run(True), run(False), "replaced before step")


def test_lora_streamed_frozen_base_with_hybrid_adam_on_the_adapters(stores):
    """``frozen_only``: the base streams from NVMe, HybridAdam (state on NVMe) steps only the
    resident adapters; checkpointing, block-major, 2 micro-batches, clipping."""
    kw = dict(lora=True, ckpt=True, major=True)
    want = _train(stores, False, **kw)
    got = _train(stores, True, **kw)
    assert_same_run(got, want, "lora")


def test_eval_zero_grad_and_a_failed_forward_between_steps(stores):
    """With ``param_sync="forward"`` (the step completes at the next pass): an evaluation under
    ``no_grad`` before every step, a forward that raises in block 2 at step 3, and
    ``zero_grad(set_to_none=False)``; the evaluation losses are compared too."""
    def between(run, step):
        with torch.no_grad():
            run.losses.append(run.model(*batches(100 + step, 1)[0])[1].reshape(1))
        if step == 3:
            h = run.model.blocks[2].register_forward_hook(_boom)
            with pytest.raises(RuntimeError, match="boom"):
                forward_backward(run.model, batches(50, 1))
            h.remove()

    def train(streamed):
        run = Run(stores, streamed, tier="nvme", state_tier="cpu", clip=None, sync="forward")
        try:
            for s in range(STEPS):
                between(run, s)
                run.step(s, set_to_none=False)
            return run.result()
        finally:
            run.close()

    assert_same_run(train(True), train(False), "eval")


def _boom(module, args, out):
    raise RuntimeError("boom")


def test_checkpoint_resume_at_tier_nvme_and_close_then_continue_unstreamed(stores, tmp_path):
    """``tiermem.checkpoint`` at step 4 of a streamed run (weights and state on NVMe), resumed
    into a fresh streamed model and HybridAdam; ``stream.close()`` while that HybridAdam steps
    it is refused; after ``opt.close()`` the stream closes, and an unstreamed HybridAdam loaded
    from the state continues; all 8 steps equal to one unstreamed run."""
    want = _train(stores, False)
    first = Run(stores, True)
    for s in range(4):
        first.step(s)
    path = tmp_path / "ck.pt"
    first.opt.synchronize()
    save_checkpoint(path, model=first.model, optimizer=first.opt)
    losses = list(first.losses)
    first.close()
    second = Run(stores, True, seed=1)  # other initial weights: the load matters
    load_checkpoint(path, model=second.model, optimizer=second.opt)
    for s in range(4, 6):
        second.step(s)
    with pytest.raises(RuntimeError, match="close\\(\\) the optimizer first"):
        second.stream.close()
    second.opt.synchronize()
    state = second.opt.state_dict()
    second.opt.close()
    second.stream.close()  # the weights are ordinary parameters again
    second.stream = None
    second.opt = HybridAdam(second.model.parameters(), lr=3e-3, weight_decay=0.1,
                            offload_fraction=1.0, chunk_numel=2048, max_grad_norm=0.5,
                            grad_accumulation_steps=2)
    second.opt.load_state_dict(state)
    for s in range(6, STEPS):
        second.step(s)
    got = second.result()
    second.close()
    assert_same_run((losses + got[0], got[1]), want, "resumed")



@pytest.mark.parametrize("how", ["close", "finalize"])
def test_optimizer_closed_while_a_pass_is_open(stores, how):
    """A loss computed with autograd on (a validation loss kept for logging) holds a pass open
    when training ends; HybridAdam's ``close()`` (or its finalizer) then disconnects from the
    stream. Before, ``connect(None)`` refused during a pass: ``close()`` raised half-way (hooks
    left, RAM chunks held) and, finalized, the dead link made ``stream.close()`` refuse forever."""
    import gc

    run = Run(stores, True, tier="cpu", state_tier="cpu", n_micro=1)
    for s in range(2):
        run.step(s)
    run.opt.synchronize()
    trained = {k: v.clone() for k, v in run.model.state_dict().items()}
    logits, loss = run.model(*batches(99, 1)[0])  # the pass stays open while these live
    if how == "close":
        run.opt.close()
    else:
        run.opt = None
        gc.collect()
    del logits, loss
    run.stream.close()
    for k, v in run.model.state_dict().items():
        assert torch.equal(v, trained[k]), k
