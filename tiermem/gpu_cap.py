"""Capping this process's GPU memory to stand for a smaller card (``--gpu-bytes``: the flag of
``tiermem plan``, ``tiermem bench stream``, examples/train_large.py and examples/train_lora.py),
with ``torch.cuda.set_per_process_memory_fraction``.

Note [GPU cap device index]: ``set_per_process_memory_fraction`` (torch 2.11) refuses a device
without an index (``torch.device("cuda")``: "Expected a torch.device with a specified index"),
so every cap goes through :func:`cuda_index`, which names the current device for a bare
``"cuda"``. The 8B streaming preset's first H200 run failed so in session 15
(docs/results/large_8b_stream_s15.log), as the LoRA stream's had in session 14.
"""

from __future__ import annotations

import torch

from tiermem.names import parse_bytes


def cuda_index(device: torch.device | str) -> int:
    """``device``'s index, the current CUDA device for a bare ``"cuda"`` (Note [GPU cap device
    index]).

    Raises:
        ValueError: ``device`` is not a CUDA device.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device={device}: a CUDA device is needed to cap its memory")
    return device.index if device.index is not None else torch.cuda.current_device()


def cap_gpu(device: torch.device | str, gpu_bytes: int | str) -> tuple[int, int]:
    """Cap this process's memory on CUDA ``device`` at ``gpu_bytes`` (bytes, or a size such as
    ``"24GiB"``), after emptying torch's cache. Returns ``(cap, total)`` in bytes: the cap and
    the device's total memory.

    Raises:
        ValueError, TypeError: ``gpu_bytes`` is not a byte count > 0, or ``device`` is not a
            CUDA device.
    """
    cap = parse_bytes(gpu_bytes, "--gpu-bytes")
    if cap <= 0:
        raise ValueError(f"--gpu-bytes={gpu_bytes!r} must be > 0, e.g. 24GiB")
    if torch.device(device).type != "cuda":
        raise ValueError(f"--gpu-bytes={gpu_bytes!r} caps a CUDA device, not {device}; fix: "
                         f"--device cuda, or drop --gpu-bytes")
    index = cuda_index(device)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), index)
    return cap, total


def uncap_gpu(device: torch.device | str) -> None:
    """Lift :func:`cap_gpu`'s cap on ``device`` (a fraction of 1.0).

    Raises:
        ValueError: ``device`` is not a CUDA device.
    """
    torch.cuda.set_per_process_memory_fraction(1.0, cuda_index(device))
