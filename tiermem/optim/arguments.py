"""HybridAdam's argument checks: each value's range or choices and the cross-field rules,
with the shared checks of :mod:`tiermem.names` (one spelling and one message per value, as
:class:`tiermem.config.OptimizerConfig` checks the same fields with its own prefix).
"""

from __future__ import annotations

from typing import Any

import torch

from tiermem.names import (MOMENTS_DTYPES, PARAM_SYNCS, PLACEMENTS, STATE_TIERS, check_bool,
                           check_choice, check_fraction, check_int, check_number, parse_dtype)


def check_arguments(*, lr: float, betas: Any, eps: float, weight_decay: float, adamw: bool,
                    maximize: bool, offload_fraction: float, state_tier: str, store: Any,
                    nvme_dir: str | None, overlap: bool, chunk_numel: int | None,
                    max_grad_norm: float | None, grad_accumulation_steps: int,
                    moments_dtype: torch.dtype | str, cpu_threads: int | None,
                    nvme_lookahead_chunks: int, data_parallel: bool | None, process_group: Any,
                    bucket_numel: int, param_sync: str, placement: str,
                    gpu_step_fraction: float) -> tuple[float, torch.dtype, float]:
    """Check :class:`~tiermem.optim.HybridAdam`'s arguments (see its docstring for each);
    return the normalized ``(offload_fraction, moments_dtype, gpu_step_fraction)``.

    Raises:
        ValueError: a value out of range or not one of the choices, NVMe without a spill
            directory or nvme tier, ``state_tier="split"`` without a store with an nvme tier,
            or ``process_group`` with ``data_parallel=False``; each naming the field and fix.
        TypeError: a number, int or flag of the wrong type (a bool where a number is wanted
            included).
    """
    # The shared checks of tiermem.names, as OptimizerConfig makes them: one spelling and one
    # message per value everywhere. The prefix is plain "HybridAdam: ": the rank prefix
    # (self._who) needs the mode, known only once the params are read.
    who = "HybridAdam: "
    check_number(who, "lr", lr, low=0.0)
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
        raise ValueError(f"HybridAdam: betas={betas!r} must be two numbers (the averaging "
                         f"coefficients of the gradient and of its square), e.g. (0.9, 0.999)")
    for i, beta in enumerate(betas):
        check_number(who, f"betas[{i}]", beta, low=0.0, high=1.0, high_open=True)
    check_number(who, "eps", eps, low=0.0)
    check_number(who, "weight_decay", weight_decay, low=0.0)
    check_bool(who, "adamw", adamw)
    check_bool(who, "maximize", maximize)
    offload_fraction = check_fraction(
        who, "offload_fraction", offload_fraction, "it is the fraction of parameter bytes "
        "whose optimizer state leaves the GPU (0.0 = none, 1.0 = all)")
    check_choice(who, "state_tier", state_tier, STATE_TIERS,
                 "cpu is pinned RAM, nvme spill files, split RAM up to the store's cpu budget "
                 "and the rest on NVMe")
    if state_tier == "split" and (store is None or store.config.nvme_bytes == 0):
        raise ValueError("HybridAdam: state_tier='split' places chunks by the budgets of the "
                         "store you pass: give store=TierStore(StoreConfig(cpu_bytes=..., "
                         "nvme_bytes=..., nvme_dir=...)) with nvme_bytes > 0")
    if state_tier == "nvme" and store is None and not nvme_dir:
        raise ValueError("HybridAdam: state_tier='nvme' needs a spill directory: pass "
                         "nvme_dir='/path/on/ssd' or a store with StoreConfig.nvme_bytes > 0")
    if state_tier == "nvme" and store is not None and store.config.nvme_bytes == 0:
        raise ValueError("HybridAdam: state_tier='nvme' but the store has no nvme tier "
                         "(StoreConfig.nvme_bytes=0); give it nvme_bytes and nvme_dir")
    check_bool(who, "overlap", overlap)
    if chunk_numel is not None:
        check_int(who, "chunk_numel", chunk_numel, low=1024, unit="elements",
                  fix="or None to size it from the model")
    if max_grad_norm is not None:
        check_number(who, "max_grad_norm", max_grad_norm, low=0.0, low_open=True,
                     fix="or None for no clipping")
    check_int(who, "grad_accumulation_steps", grad_accumulation_steps, low=1,
              fix="the backward passes per step()")
    moments_dtype = parse_dtype(who, "moments_dtype", moments_dtype, MOMENTS_DTYPES)
    if cpu_threads is not None:
        check_int(who, "cpu_threads", cpu_threads, low=1, unit="threads",
                  fix="or None for torch's thread count")
    check_int(who, "nvme_lookahead_chunks", nvme_lookahead_chunks, low=0, unit="chunks")
    if data_parallel is not None:
        check_bool(who, "data_parallel", data_parallel)
    check_int(who, "bucket_numel", bucket_numel, low=1, unit="elements",
              fix="the elements per gradient-reduce bucket")
    check_choice(who, "param_sync", param_sync, PARAM_SYNCS,
                 "step: the updated params are ready when step() returns, forward: the next "
                 "forward waits per module")
    check_choice(who, "placement", placement, PLACEMENTS,
                 "trace: the split follows the gradient order of the first backward, given: "
                 "the order the params were given in")
    gpu_step_fraction = check_fraction(
        who, "gpu_step_fraction", gpu_step_fraction, "it is the share of the offloaded chunks "
        "the GPU steps by streaming their state through it (0.0: the CPU steps all)")
    if process_group is not None and data_parallel is False:
        raise ValueError("HybridAdam: process_group is given but data_parallel=False; drop "
                         "process_group, or set data_parallel=True to shard the state over it")
    return offload_fraction, moments_dtype, gpu_step_fraction


def params_device(all_params: list[torch.Tensor]) -> torch.device:
    """The one device of ``all_params``.

    Raises:
        TypeError: a param that is not floating-point.
        ValueError: params on several devices.
    """
    for i, p in enumerate(all_params):
        if not p.is_floating_point():
            raise TypeError(f"HybridAdam: param {i} has dtype {p.dtype}; only floating-point "
                            f"params can be optimized")
    devices = {p.device for p in all_params}
    if len(devices) != 1:
        raise ValueError(f"HybridAdam: params are on several devices {sorted(map(str, devices))}; "
                         f"put the model on one device (use one HybridAdam per device)")
    return devices.pop()


def check_store_device(store: Any, device: torch.device) -> None:
    """Refuse a given store on another device than the params (``store=None``: nothing).

    Raises:
        ValueError: the store's device is not ``device``.
    """
    if store is not None and store.device != device:
        raise ValueError(f"HybridAdam: params are on {device} but the store's device is "
                         f"{store.device}; make the store with StoreConfig.device="
                         f"{str(device)!r}")
