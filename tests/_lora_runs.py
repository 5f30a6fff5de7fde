"""The comparison the streamed-LoRA tests make (tests/test_lora_stream.py,
tests/stream/test_stream_nvme_home.py): two runs' per-step ``(loss, [adapters])``."""

from __future__ import annotations

import torch


def assert_same_lora_run(got, ref, steps: int) -> None:
    """``got`` equals ``ref`` bit for bit, ``steps`` steps of ``(loss, [adapters])``, and ``ref``
    trains: its loss and every adapter move at every step (else equality proves nothing)."""
    assert len(got) == len(ref) == steps
    for step in range(1, steps):  # the run trains: adapters and losses move every step
        assert not torch.equal(ref[step][0], ref[step - 1][0])
        assert all(not torch.equal(a, b) for a, b in zip(ref[step][1], ref[step - 1][1]))
    for step, ((loss, ad), (ref_loss, ref_ad)) in enumerate(zip(got, ref)):
        assert torch.equal(loss, ref_loss), f"step {step}: loss {loss} != {ref_loss}"
        assert all(torch.equal(a, b) for a, b in zip(ad, ref_ad)), f"step {step}: adapters"
