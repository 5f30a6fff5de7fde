"""The workload of ``tiermem tune``: training steps of a GPT (:mod:`tiermem.models.gpt`) with
activation offload and HybridAdam, one :class:`~tiermem.apps.tune.results.Trial` per setting
(:func:`gpt_factory`)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch

from tiermem.config import parse_bytes
from tiermem.telemetry.saved import SavedBytesCounter
from tiermem.apps.tune.results import Trial


def _saved_bytes(model: torch.nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> tuple[int, int]:
    """Return the bytes autograd saves in one forward of ``model`` (each storage once,
    parameters not counted), and those first saved inside one of ``model.blocks``, per block
    (the mean; what offloading one block moves)."""
    counter = SavedBytesCounter({p.untyped_storage().data_ptr() for p in model.parameters()},
                                model.blocks)
    try:
        with counter.hooks():
            loss = model(idx, tgt)[1]
        loss.backward()
    finally:
        counter.close()
    model.zero_grad(set_to_none=True)
    return counter.forward_bytes, counter.block_bytes // max(1, len(model.blocks))


def act_gpu_bytes(value: float | str, block_bytes: int) -> int:
    """Return the activation store's gpu budget in bytes for an ``act_gpu_budget`` setting.

    Args:
        value: a number of blocks' worth of saved activations (``1.5``, ``"1.5"``: one and a
            half times what one block saves), or bytes with a unit (``"3GiB"``).
        block_bytes: bytes one block saves (see :func:`gpt_factory`).

    Raises:
        ValueError: not a positive number of blocks nor a byte size.
    """
    try:
        if isinstance(value, str) and value.strip()[-1:].isalpha():
            return parse_bytes(value, "act_gpu_budget")
        blocks = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"act_gpu_budget={value!r} is neither a number of blocks (1.5) nor a "
                         f"byte size with a unit ('3GiB')") from None
    if not blocks > 0 or math.isinf(blocks):
        raise ValueError(f"act_gpu_budget={value!r} must be a positive number of blocks")
    return max(1, int(blocks * block_bytes))


def gpt_factory(cfg: Any, batch: int, device: torch.device, nvme_dir: str,
                chunk_numel: int | None = None, cpu_threads: int | None = 1,
                dtype: torch.dtype = torch.float32) -> Callable[[dict], Trial]:
    """Return a factory of GPT training steps for :func:`~tiermem.apps.tune.runner.tune`.

    Settings (all optional): ``num_layers`` (blocks whose activations are offloaded; 0: none;
    ``"auto"``: chosen by measurement, ``offload_activations(layers="auto")``),
    ``prefetch_depth``, ``offload_fraction`` and ``state_tier`` of HybridAdam, ``policy``
    (``"lru"`` / ``"trace"``), ``prefetch_lookahead`` and ``act_gpu_budget`` of the activation
    store. ``act_gpu_budget`` bounds the reloaded activations the store keeps on the device, in
    blocks' worth of saved activations (``1.5``) or bytes (``"3GiB"``, see
    :func:`act_gpu_bytes`); below ``prefetch_depth + 1`` blocks, prefetches must evict, which is
    where the policies differ. Default: twice all saved activations (never evicts). The
    activation store's cpu tier also holds twice the saved activations (pinned as needed, in
    256 MiB slabs). HybridAdam steps on ``cpu_threads`` threads (1 leaves the other cores to the
    model's compute; None: all), in chunks of ``chunk_numel`` parameters (None: nparams / 64
    within [2^14, 2^22]). Both stores call ``mark_step`` after every step; the activation store
    is the trial's telemetry store. The trial's counters: bytes offloaded (put into the store),
    evicted (gpu -> cpu moves other than puts) and refetched (reloads beyond one per offloaded
    byte), reloads copied past a full gpu tier (``direct_reloads``) and, with the trace policy,
    steps that followed its recording (1 per step when it always did). The model is built on
    ``device`` in ``dtype``. On a machine without CUDA the device peak is estimated as
    parameters + gradients + GPU-side optimizer state + the saved activations that stay on the
    device.

    The returned factory has ``saved_bytes`` (all saved activations of a step) and
    ``block_bytes`` (per block) attributes.
    """
    from tiermem.models.gpt import GPT
    from tiermem.config import StoreConfig
    from tiermem.offload import offload_activations
    from tiermem.optim import HybridAdam
    from tiermem.store.trace import TracePolicy
    from tiermem.store import TierStore
    from tiermem.store.policies import make_policy

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        with device:  # initialised in place: a large model is slow to initialise on the host
            return GPT(cfg).to(dtype)

    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen).to(device)
    tgt = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen).to(device)
    probe = build()
    saved_bytes, block_bytes = _saved_bytes(probe, idx, tgt)
    del probe

    def factory(setting: dict) -> Trial:
        model = build()
        nparams = sum(p.numel() for p in model.parameters())
        fraction = float(setting.get("offload_fraction", 0.0))
        opt = HybridAdam(model.parameters(), lr=1e-3, offload_fraction=fraction,
                         state_tier=setting.get("state_tier", "cpu"), nvme_dir=nvme_dir,
                         chunk_numel=chunk_numel or max(1 << 14, min(1 << 22, nparams // 64)),
                         cpu_threads=cpu_threads)
        act_bytes = max(1 << 20, 2 * saved_bytes)
        budget = setting.get("act_gpu_budget")
        policy = make_policy(setting.get("policy", "lru"))
        try:  # the pool pins 256 MiB slabs as they are needed, not its whole budget at once
            store = TierStore(StoreConfig(
                gpu_bytes=act_bytes if budget is None else act_gpu_bytes(budget, block_bytes),
                cpu_bytes=act_bytes, pool_slab_bytes=min(256 << 20, act_bytes),
                device=str(device), policy=policy,
                prefetch_lookahead=int(setting.get("prefetch_lookahead", 0))))
        except BaseException:
            opt.close()
            raise
        n = setting.get("num_layers", 0)
        layer_arg = {"layers": "auto"} if n == "auto" else {"num_layers": int(n)}
        off = offload_activations(model.blocks, store=store, **layer_arg,
                                  prefetch_depth=int(setting.get("prefetch_depth", 1))) \
            if n == "auto" or int(n) > 0 else None
        put_per_step = [0]

        def step() -> None:
            before = off.counters["put_bytes"] if off is not None else 0
            with off if off is not None else contextlib.nullcontext():
                loss = model(idx, tgt)[1]
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            store.mark_step()
            opt.store.mark_step()
            put_per_step[0] = (off.counters["put_bytes"] if off is not None else 0) - before

        def device_peak() -> int:
            static = sum(p.numel() * p.element_size() * 2 for p in model.parameters())
            return static + opt.memory_bytes()["gpu"] + max(0, saved_bytes - put_per_step[0]) \
                + store.stats()["gpu"]["peak_bytes"]

        def counters() -> dict[str, float]:
            moved = store.stats()["moved_bytes"]
            put = off.counters["put_bytes"] if off is not None else 0
            out = {"offloaded_bytes": put,  # D2H counts the puts only from a device
                   "evicted_bytes": moved.get("gpu->cpu", 0) - (put if device.type != "cpu" else 0),
                   "refetched_bytes": moved.get("cpu->gpu", 0) - put}
            if off is not None:
                out["direct_reloads"] = off.counters["gpu_full"]
            if isinstance(policy, TracePolicy):
                out["followed_steps"] = policy.counts["followed_steps"]
            return out

        def close() -> None:
            opt.close()
            store.close()

        return Trial(step=step, stores=[store, opt.store],
                     adam_params=int(round(fraction * nparams)),
                     device_peak_bytes=None if device.type == "cuda" else device_peak,
                     close=close, telemetry_stores=[store], counters=counters)

    factory.saved_bytes = saved_bytes  # type: ignore[attr-defined]
    factory.block_bytes = block_bytes  # type: ignore[attr-defined]
    return factory
