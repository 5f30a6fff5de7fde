"""HybridAdam's argument checks: each value's range or choices, defined once for the
``optimizer`` section in :mod:`tiermem.options` (Note [one definition]: one spelling and one
message per value, as :class:`tiermem.config.OptimizerConfig` checks the same fields with its
own prefix), and the rules that need the runtime objects (``store``, ``process_group``).
"""

from __future__ import annotations

from typing import Any

import torch

from tiermem import options


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
    # Note [one definition] in tiermem/options.py: each field's check is the one the
    # optimizer section defines, as OptimizerConfig makes it. The prefix is plain
    # "HybridAdam: ": the rank prefix (self._who) needs the mode, known only once the params
    # are read.
    given = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw=adamw,
                 maximize=maximize, offload_fraction=offload_fraction, state_tier=state_tier,
                 nvme_dir=nvme_dir, overlap=overlap, chunk_numel=chunk_numel,
                 max_grad_norm=max_grad_norm, grad_accumulation_steps=grad_accumulation_steps,
                 moments_dtype=moments_dtype, cpu_threads=cpu_threads,
                 nvme_lookahead_chunks=nvme_lookahead_chunks, data_parallel=data_parallel,
                 bucket_numel=bucket_numel, param_sync=param_sync, placement=placement,
                 gpu_step_fraction=gpu_step_fraction)
    checked = options.check_section("optimizer", options.Who("HybridAdam: "), given, "api")
    # the rules that need the runtime objects (store, process_group), checked here only
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
    if process_group is not None and data_parallel is False:
        raise ValueError("HybridAdam: process_group is given but data_parallel=False; drop "
                         "process_group, or set data_parallel=True to shard the state over it")
    return (checked["offload_fraction"], getattr(torch, checked["moments_dtype"]),
            checked["gpu_step_fraction"])


def params_device(all_params: list[torch.Tensor]) -> torch.device:
    """The one device of ``all_params``.

    Note [shared storage]: two distinct Parameters viewing one storage (slices of one buffer,
    ``nn.Parameter(p.data)``) share its version counter and bytes, while HybridAdam keeps one
    fp32 master and one change record per param (Note [param changes]): each write-back looked
    like a user change of the other, and the first step failed with a misleading "changed
    while the step was still updating it". They are refused here, at construction. A tied
    weight (one Parameter used twice) is one param and is fine.

    Raises:
        TypeError: a param that is not floating-point.
        ValueError: params on several devices; two params sharing one storage; a
            non-contiguous param (a transposed view made a Parameter: it crashed in the first
            flat view, "view size is not compatible").
    """
    storages: dict[int, int] = {}
    for i, p in enumerate(all_params):
        if not p.is_floating_point():
            raise TypeError(f"HybridAdam: param {i} has dtype {p.dtype}; only floating-point "
                            f"params can be optimized")
        if type(p) in (torch.Tensor, torch.nn.Parameter) and not p.is_contiguous():
            raise ValueError(f"HybridAdam: param {i} (shape {tuple(p.shape)}, stride {p.stride()})"
                             f" is not contiguous; HybridAdam steps params through flat views: "
                             f"make it contiguous (nn.Parameter(t.contiguous()))")
        if type(p) in (torch.Tensor, torch.nn.Parameter) and p.numel() and p.device.type != "meta":
            j = storages.setdefault(p.untyped_storage().data_ptr(), i)
            if j != i:
                raise ValueError(f"HybridAdam: params {j} and {i} (shapes "
                                 f"{tuple(all_params[j].shape)} and {tuple(p.shape)}) share one "
                                 f"storage; HybridAdam keeps one "
                                 f"master per param: give each its own (nn.Parameter(t.clone())), "
                                 f"or use one Parameter for a tied weight (Note [shared storage])")
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
