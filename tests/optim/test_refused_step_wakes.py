"""A step() refused by its checks (a gradient changed after backward handed it over, more
backward passes than ``grad_accumulation_steps``) fails the chunks waiting for it and leaves
HybridAdam usable; it never leaves the worker waiting for a verdict that no step() will give.

Found in session 16: since HybridAdam holds every chunk of its first overlapped step for
``step()`` (to learn of a GradScaler, Note [grad scaler overlap] in amp_scaling.py), a first
step refused by ``check_grads_untouched`` left the worker waiting on ``compute_allowed`` with
nothing to set it: the optimizer's finalizer then joined the worker forever (two integration
tests, tests/integrations/test_accelerate.py and test_hf_trainer.py, hung). Training after the
refused step must equal AdamW(fused) trained on the same batches without it, bit for bit
(f=1.0: the CPU kernel and torch's fused CPU AdamW agree exactly on fp32), for 8 more steps.
"""

from __future__ import annotations

import threading

import pytest
import torch

from models import TinyGPT, make_batch
from tiermem.optim import HybridAdam

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEPS = 8
GUARD_S = 60  # deadlock guard: never reached when the code is right


def _model():
    torch.manual_seed(0)
    return TinyGPT()


def _close_within_guard(opt):
    done = threading.Event()
    thread = threading.Thread(target=lambda: (opt.close(), done.set()), daemon=True)
    thread.start()
    assert done.wait(GUARD_S), "close() hung: the worker waits for a step that never comes"


@pytest.mark.parametrize("how", ["clip_after_backward", "extra_pass"])
def test_a_refused_first_step_leaves_hybrid_adam_usable(how):
    ref, model = _model(), _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, fused=True)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                     placement="given")
    idx, tgt = make_batch(100)
    model(idx, tgt)[1].backward()  # the first step's chunks are held for step()
    if how == "clip_after_backward":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        match = "changed after backward"
    else:
        model(idx, tgt)[1].backward()  # a second pass with grad_accumulation_steps=1
        match = "backward passes"
    with pytest.raises(RuntimeError, match=match):
        opt.step()
    opt.zero_grad(set_to_none=True)
    for step in range(STEPS):  # then training goes on as if that step had not been made
        idx, tgt = make_batch(step)
        for m, o in ((ref, ref_opt), (model, opt)):
            m(idx, tgt)[1].backward()
            o.step()
            o.zero_grad(set_to_none=True)
    opt.synchronize()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    _close_within_guard(opt)
