"""The private store's defaults: what ``offload_activations(store=None)`` makes on first entry
(units: bytes)."""

from __future__ import annotations

import os

import torch

from tiermem.config import StoreConfig

_HOST_FRACTION = 0.5  # share of MemAvailable a private store may pin for its cpu tier


def available_host_bytes() -> int:
    """Return the host memory available to new allocations in bytes (``MemAvailable``).

    Falls back to free physical pages where ``/proc/meminfo`` is missing.
    """
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_store_config() -> StoreConfig:
    """Return the config of the private store made when ``offload_activations(store=None)``.

    cpu tier: half of the host memory available now (``MemAvailable``; pinned on CUDA, taken
    lazily in slabs of up to 256 MiB, so a large budget costs nothing until used). gpu tier (the
    reloaded activations, which would be on the device anyway without offload): the device's
    total memory on CUDA, the cpu budget otherwise. No nvme tier: spilling to disk needs a store
    made with ``nvme_bytes`` and ``nvme_dir`` (a default directory could be a RAM disk).
    """
    cpu_bytes = max(1 << 20, int(available_host_bytes() * _HOST_FRACTION) // 4096 * 4096)
    if torch.cuda.is_available():
        gpu_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    else:
        gpu_bytes = cpu_bytes
    return StoreConfig(gpu_bytes=gpu_bytes, cpu_bytes=cpu_bytes, nvme_bytes=0,
                       pool_slab_bytes=min(256 << 20, cpu_bytes))
