"""What every ``tiermem bench`` shares: the device it runs on and timing that waits for the
device (the byte columns are :func:`tiermem.names.gib` / :func:`tiermem.names.mib`)."""

from __future__ import annotations

import time
from typing import Callable

import torch

from tiermem.names import resolve_device


def bench_device() -> torch.device:
    """The current CUDA device when CUDA is present, else the CPU."""
    return resolve_device("auto")


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # benchmark timing only: the timed work must have finished


def time_s(fn: Callable[[], object], repeats: int, device: torch.device | None = None,
           warmup: int = 1) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn()`` after ``warmup`` untimed ones, each
    ended by :func:`sync` of ``device`` (None: host work only)."""
    def once() -> None:
        fn()
        if device is not None:
            sync(device)

    for _ in range(warmup):
        once()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return times
