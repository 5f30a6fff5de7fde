"""Note [streamed state dicts] on CUDA: a streamed GPT (pinned host copies, a CUDA copy stream)
trained by HybridAdam with ``param_sync="forward"``; ``model.state_dict()`` right after each
``step()`` (the worker held back until something completes the step: the gated worker of
tests/stream/test_stream_checkpoints.py) equals the state dict after ``opt.synchronize()``, and
``model.state_dict()`` during an open pass (released blocks' data empty on the device) equals
the one before the forward. These compare copies of the same weights, so they are exact on any
device; the same test runs on the CPU as a smoke of it."""

from __future__ import annotations

import pytest
import torch

from tiermem.optim.hybrid_adam import HybridAdam
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights

from _stream_train import batches, make_model
from test_stream_checkpoints import gated_worker  # noqa: F401  (a fixture)

STEPS = 6


def _host(sd: dict) -> dict:
    return {k: v.detach().to("cpu", copy=True) for k, v in sd.items()}


def _corners(device: torch.device, make_stream_store, gate) -> None:
    model = make_model().to(device)
    store = make_stream_store(device=str(device), gpu_bytes=0 if device.type == "cpu" else 1 << 20,
                              cpu_bytes=8 << 20)
    stream = stream_weights(model.blocks, store=store, tier="cpu", prefetch_blocks=1)
    opt = HybridAdam(model.parameters(), lr=3e-3, weight_decay=0.1, offload_fraction=0.5,
                     chunk_numel=2048, max_grad_norm=1e9, param_sync="forward")
    moved = 0
    try:
        for s in range(STEPS):
            mbs = [(i.to(device), t.to(device)) for i, t in batches(s, 1)]
            if s == 2:  # a pass held open by a loss kept for logging
                before = _host(model.state_dict())
                _, loss = model(*mbs[0])
                assert stream.in_pass
                during = _host(model.state_dict())
                for k, v in before.items():
                    assert torch.equal(during[k], v), f"open pass: {k}"
                loss.backward()
            else:
                forward_backward(model, mbs)
            gate.clear()
            old = _host(model.state_dict()) if s == 0 else None
            opt.step()
            early = _host(model.state_dict())  # the step still pending: completed by the hook
            opt.synchronize()
            late = _host(model.state_dict())
            for k, v in late.items():
                assert torch.equal(early[k], v), f"after step {s}: {k}"
            if old is not None:
                moved = sum(not torch.equal(old[k], late[k]) for k in late if "blocks." in k)
            opt.zero_grad(set_to_none=True)
    finally:
        opt.close()
        stream.close()
    assert moved > 0  # the streamed weights changed at the step


def test_cpu_smoke_of_the_cuda_corners(make_stream_store, gated_worker, one_thread):  # noqa: F811
    _corners(torch.device("cpu"), make_stream_store, gated_worker)


@pytest.mark.cuda
def test_cuda_streamed_state_dict_after_step_and_during_a_pass(make_stream_store,
                                                               gated_worker):  # noqa: F811
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _corners(torch.device("cuda"), make_stream_store, gated_worker)
