"""tiermem.gpu_cap: the cap names the device by index (Note [GPU cap device index])."""

from __future__ import annotations

import pytest
import torch

from tiermem import gpu_cap


@pytest.fixture
def fake_cuda(monkeypatch):
    seen = []

    def fraction(f, device=None):
        torch.cuda._utils._get_device_index(device)  # torch's own check: raises without one
        seen.append((f, device))

    props = type("P", (), {"total_memory": 4 << 30})
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", fraction)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return seen


def test_a_bare_cuda_device_is_capped_by_its_index(fake_cuda):
    assert gpu_cap.cap_gpu("cuda", "1GiB") == (1 << 30, 4 << 30)
    gpu_cap.uncap_gpu(torch.device("cuda"))
    assert gpu_cap.cap_gpu(torch.device("cuda"), 8 << 30) == (8 << 30, 4 << 30)
    assert fake_cuda == [(0.25, 0), (1.0, 0), (1.0, 0)]


def test_torch_refuses_the_bare_device_the_cap_must_not_pass(fake_cuda):
    """The fake is torch's own check: it refuses what train_large passed before the fix."""
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_per_process_memory_fraction(0.5, torch.device("cuda"))


@pytest.mark.parametrize("size, match", [("0", "must be > 0"), ("lots", "gpu-bytes")])
def test_a_bad_size_names_the_flag(fake_cuda, size, match):
    with pytest.raises((ValueError, TypeError), match=match):
        gpu_cap.cap_gpu("cuda", size)
    assert fake_cuda == []


def test_a_cpu_device_is_refused(fake_cuda):
    with pytest.raises(ValueError, match="caps a CUDA device"):
        gpu_cap.cap_gpu("cpu", "1GiB")
