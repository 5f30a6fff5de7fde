"""Typed configuration objects, checked at construction, with YAML files and dotted overrides.

Every config is a keyword-only dataclass; each field's docstring gives its unit and default.
Byte sizes accept ints or strings such as ``"512MiB"`` / ``"4GB"``. Bad values raise
``ValueError``/``TypeError`` at construction naming the field, the value and the fix.

``load_config(path, overrides)`` reads a YAML file into a nested dict, applies Megatron-style
dotted overrides (``optimizer.offload_fraction=0.5``) and returns it; the sections are turned
into the dataclasses below by their users.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import yaml

logger = logging.getLogger("tiermem")

TIERS = ("gpu", "cpu", "nvme")
"""Tier names, fastest first. Victims move down this list."""

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


def parse_bytes(value: int | float | str, field: str) -> int:
    """Return a byte count from an int or a string such as ``"1.5GiB"``.

    Args:
        value: bytes as an int (or integral float), or a number with a unit (B, KB, MB, GB, TB,
            KiB, MiB, GiB, TiB; case-insensitive).
        field: the config field's name, used in error messages.

    Raises:
        ValueError: unparsable string, unknown unit, negative, non-integral or non-finite
            (``inf``, ``nan``, ``"1e400"``) count.
        TypeError: value is neither a number nor a string.
    """
    if isinstance(value, bool):
        raise TypeError(f"{field} must be a byte count (int or '4GiB'), got bool {value!r}")
    original = value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"{field}={value!r} is not a byte size; write an integer number of bytes or a "
                f"number with a unit such as '512MiB' or '4GB'")
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not isinstance(value, (int, float)):
        raise TypeError(f"{field} must be a byte count (int or '4GiB'), got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{field}={original!r} is not a finite byte size; write an integer "
                         f"number of bytes or a number with a unit such as '512MiB' or '4GB'")
    if value < 0:
        raise ValueError(f"{field}={value!r} is negative; a budget is a byte count >= 0 "
                         f"(0 disables the tier)")
    if float(value) != int(value):
        raise ValueError(f"{field}={value!r} is not a whole number of bytes")
    return int(value)


def _warn_unused_nvme_dir(nvme_dir: str) -> None:
    """Say that ``nvme_dir`` without ``nvme_bytes`` leaves the nvme tier off (logger and
    ``UserWarning``): 0 is the documented off switch, so it is not refused."""
    msg = (f"StoreConfig.nvme_dir={nvme_dir!r} is ignored because StoreConfig.nvme_bytes=0 "
           f"(the nvme tier is off); set nvme_bytes (e.g. '64GiB') to spill there, or drop "
           f"nvme_dir")
    logger.warning(msg)
    warnings.warn(msg, UserWarning, stacklevel=4)


def _check_choice(field: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{field}={value!r} is not one of {', '.join(map(repr, choices))}")


@dataclass(kw_only=True)
class StoreConfig:
    """Configuration of a :class:`tiermem.TierStore`. All budgets are hard limits in bytes."""

    gpu_bytes: int | str = "2GiB"
    """Budget of the ``"gpu"`` tier (on a machine without CUDA: a device tier in host memory)."""
    cpu_bytes: int | str = "4GiB"
    """Budget of the ``"cpu"`` tier: host memory from the (pinned, when CUDA is there) pool."""
    nvme_bytes: int | str = 0
    """Budget of the ``"nvme"`` tier: bytes of spill-file extents. 0 disables the tier."""
    nvme_dir: str | None = None
    """Base directory for spill files; the store makes a private (0700) subdirectory in it.
    Required when ``nvme_bytes`` > 0."""
    device: str = "auto"
    """Compute device of the ``"gpu"`` tier: ``"auto"`` (CUDA if present, else CPU), ``"cuda"``,
    ``"cuda:N"`` or ``"cpu"``."""
    pin_memory: bool | Literal["auto"] = "auto"
    """Pin the ``"cpu"`` tier's pool (``"auto"``: when the device is CUDA)."""
    pool_slab_bytes: int | str = "256MiB"
    """Size of one host-pool slab; the pool grows by slabs up to ``cpu_bytes`` and reuses
    freed blocks (pinned allocation costs ~0.5 s/GiB)."""
    io_backend: Literal["auto", "posix", "kvikio", "aiofiles"] = "auto"
    """NVMe I/O backend. ``"auto"``: kvikio when importable and a CUDA driver is present,
    else the POSIX thread pool."""
    io_threads: int = 4
    """Threads of the I/O backend."""
    io_chunk_bytes: int | str = "8MiB"
    """Spill I/O is split into chunks of this size (each with its own checksum), done in parallel."""
    o_direct: bool | Literal["auto"] = "auto"
    """Open spill files with O_DIRECT (``"auto"``: when the filesystem supports it)."""
    checksum: bool = True
    """Verify a CRC-32C per spill chunk on read (a corrupted file raises, never returns data)."""
    policy: Any = "lru"
    """Eviction policy: ``"lru"``, ``"trace"`` or a :class:`tiermem.store.policy.Policy` instance."""
    prefetch_lookahead: int = 0
    """Accesses of the recorded step the store looks ahead after each access, prefetching them
    into free room (or over keys needed later) with :class:`tiermem.store.Prefetcher`;
    0 turns it off. Needs ``policy="trace"`` (or a ``TracePolicy`` instance)."""

    def __post_init__(self) -> None:
        for name in ("gpu_bytes", "cpu_bytes", "nvme_bytes", "pool_slab_bytes", "io_chunk_bytes"):
            setattr(self, name, parse_bytes(getattr(self, name), f"StoreConfig.{name}"))
        if self.nvme_bytes > 0 and not self.nvme_dir:
            raise ValueError(
                f"StoreConfig.nvme_bytes={self.nvme_bytes} needs a spill directory: set "
                f"StoreConfig.nvme_dir to a writable directory on an SSD, or nvme_bytes=0")
        if self.nvme_dir is not None:
            self.nvme_dir = os.fspath(self.nvme_dir)
            if self.nvme_bytes == 0:
                _warn_unused_nvme_dir(self.nvme_dir)
        if not (self.device == "auto" or self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device)):
            raise ValueError(f"StoreConfig.device={self.device!r} is not 'auto', 'cpu', 'cuda' or 'cuda:N'")
        _check_choice("StoreConfig.pin_memory", self.pin_memory, (True, False, "auto"))
        _check_choice("StoreConfig.io_backend", self.io_backend, ("auto", "posix", "kvikio", "aiofiles"))
        _check_choice("StoreConfig.o_direct", self.o_direct, (True, False, "auto"))
        if not isinstance(self.io_threads, int) or self.io_threads < 1:
            raise ValueError(f"StoreConfig.io_threads={self.io_threads!r} must be an int >= 1")
        if self.io_chunk_bytes < 4096 or self.io_chunk_bytes % 4096:
            raise ValueError(f"StoreConfig.io_chunk_bytes={self.io_chunk_bytes} must be a positive "
                             f"multiple of 4096 (O_DIRECT alignment)")
        if self.pool_slab_bytes < 4096:
            raise ValueError(f"StoreConfig.pool_slab_bytes={self.pool_slab_bytes} must be >= 4096")
        if isinstance(self.policy, str):
            _check_choice("StoreConfig.policy", self.policy, ("lru", "trace"))
        if isinstance(self.prefetch_lookahead, bool) or not isinstance(self.prefetch_lookahead, int) \
                or self.prefetch_lookahead < 0:
            raise ValueError(f"StoreConfig.prefetch_lookahead={self.prefetch_lookahead!r} must be "
                             f"an int >= 0 (accesses looked ahead; 0 turns prefetch off)")
        if self.prefetch_lookahead and self.policy == "lru":
            raise ValueError(f"StoreConfig.prefetch_lookahead={self.prefetch_lookahead} needs the "
                             f"recorded step of the trace policy: set StoreConfig.policy='trace', "
                             f"or prefetch_lookahead=0")

    def budget(self, tier: str) -> int:
        """Return the byte budget of ``tier``.

        Raises:
            ValueError: unknown tier name.
        """
        _check_choice("tier", tier, TIERS)
        return getattr(self, f"{tier}_bytes")


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    """Apply dotted ``section.field=value`` overrides to a nested dict (values parsed as YAML).

    Raises:
        ValueError: an override without ``=`` or with an empty key.
    """
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r} is not 'section.field=value' "
                             f"(e.g. optimizer.offload_fraction=0.5)")
        node = tree
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {part!r} is a value, not a section")
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
    return tree


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> dict:
    """Read a YAML config (or start empty) and apply dotted overrides.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a YAML mapping, or a malformed override.
    """
    tree: dict = {}
    if path is not None:
        with open(path) as f:
            tree = yaml.safe_load(f) or {}
        if not isinstance(tree, dict):
            raise ValueError(f"config file {path} must hold a YAML mapping of sections")
    return apply_overrides(tree, list(overrides))


def from_dict(cls, section: dict | None, name: str):
    """Build the dataclass ``cls`` from a config section, rejecting unknown fields by name.

    Raises:
        ValueError: a field that ``cls`` does not have (the message lists the valid ones).
    """
    section = dict(section or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(f'{name}.{u}' for u in unknown)}; "
                         f"valid fields of {name}: {', '.join(sorted(known))}")
    return cls(**section)


# ------------------------------------------------------------------ training-loop sections
# The sections of examples/train_gpt.py's YAML (and ``tiermem demo``) besides ``store``
# (StoreConfig) and ``model`` (tiermem.bench._gpt.GPTConfig). Each mirrors the keyword
# arguments of the API it feeds, so ``HybridAdam(params, **optimizer.kwargs())`` works.

DTYPES = ("float32", "bfloat16")
"""Parameter dtypes accepted by :class:`TrainConfig`."""


def _check_number(field: str, value: Any, *, low: float | None = None, high: float | None = None,
                  integer: bool = False, low_open: bool = False) -> None:
    kind = "an int" if integer else "a number"
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type:
        raise TypeError(f"{field} must be {kind}, got {type(value).__name__} {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{field}={value!r} must be {'>' if low_open else '>='} {low}")
    if high is not None and value > high:
        raise ValueError(f"{field}={value!r} must be <= {high}")


@dataclass(kw_only=True)
class OptimizerConfig:
    """The ``optimizer`` section: :class:`tiermem.optim.HybridAdam`'s arguments (AdamW)."""

    lr: float = 3e-3
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Coefficients of the running averages of the gradient and its square, each in [0, 1)."""
    eps: float = 1e-8
    """Term added to the denominator."""
    weight_decay: float = 0.1
    """Decoupled (AdamW) weight decay, applied to matrices only (not biases, norms)."""
    offload_fraction: float = 0.5
    """Fraction of parameter bytes whose fp32 master and moments live off the GPU, in
    [0.0, 1.0]; the last layers go first. 0.0 keeps everything on the GPU."""
    state_tier: Literal["cpu", "nvme"] = "cpu"
    """Where offloaded state lives: ``"cpu"`` (pinned RAM) or ``"nvme"`` (needs store.nvme_bytes
    and store.nvme_dir)."""
    overlap: bool = True
    """Step offloaded chunks on the CPU during backward, as their gradients land."""
    chunk_numel: int | None = None
    """Elements per offloaded chunk (unit of the CPU step and NVMe I/O), >= 1024; null: sized
    from the model (1/32 of the offloaded elements, within [2^16, 2^24])."""
    max_grad_norm: float | None = None
    """Clip gradients to this global 2-norm inside ``step()``; None: no clipping."""
    moments_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the offloaded moments: ``"float32"`` (exact torch semantics, 12 bytes of state
    per param) or ``"bfloat16"`` (8 bytes per param; moments rounded after each update)."""
    cpu_threads: int | None = None
    """Threads of the CPU step; None: torch's thread count (less one with overlap on CUDA)."""
    nvme_lookahead_chunks: int = 2
    """Chunks of NVMe-resident state read ahead of the CPU step (``state_tier="nvme"``)."""
    gpu_step_fraction: float = 0.0
    """Share of the offloaded chunks the GPU steps by streaming their state through it, in
    [0.0, 1.0] (1.0 is fastest at full offload when PCIe is not busy with activations)."""

    def __post_init__(self) -> None:
        _check_number("optimizer.lr", self.lr, low=0.0)
        if not (isinstance(self.betas, (list, tuple)) and len(self.betas) == 2):
            raise ValueError(f"optimizer.betas={self.betas!r} must be two numbers, e.g. [0.9, 0.95]")
        self.betas = tuple(self.betas)
        for i, beta in enumerate(self.betas):
            _check_number(f"optimizer.betas[{i}]", beta, low=0.0)
            if not beta < 1.0:
                raise ValueError(f"optimizer.betas[{i}]={beta!r} must be < 1.0")
        _check_number("optimizer.eps", self.eps, low=0.0)
        _check_number("optimizer.weight_decay", self.weight_decay, low=0.0)
        _check_number("optimizer.offload_fraction", self.offload_fraction, low=0.0, high=1.0)
        _check_choice("optimizer.state_tier", self.state_tier, ("cpu", "nvme"))
        _check_choice("optimizer.overlap", self.overlap, (True, False))
        if self.chunk_numel is not None:
            _check_number("optimizer.chunk_numel", self.chunk_numel, low=1024, integer=True)
        if self.max_grad_norm is not None:
            _check_number("optimizer.max_grad_norm", self.max_grad_norm, low=0.0, low_open=True)
        _check_choice("optimizer.moments_dtype", self.moments_dtype, ("float32", "bfloat16"))
        if self.cpu_threads is not None:
            _check_number("optimizer.cpu_threads", self.cpu_threads, low=1, integer=True)
        _check_number("optimizer.nvme_lookahead_chunks", self.nvme_lookahead_chunks, low=0,
                      integer=True)
        _check_number("optimizer.gpu_step_fraction", self.gpu_step_fraction, low=0.0, high=1.0)

    def kwargs(self) -> dict:
        """Keyword arguments for ``HybridAdam`` (all but params, store and accumulation steps);
        ``moments_dtype`` becomes a ``torch.dtype`` and is left out when float32 (the default)."""
        out = dataclasses.asdict(self)
        if out.pop("moments_dtype") != "float32":
            import torch  # the config module itself does not need torch
            out["moments_dtype"] = getattr(torch, self.moments_dtype)
        return out


@dataclass(kw_only=True)
class ActivationConfig:
    """The ``activations`` section: :func:`tiermem.offload.offload_activations`'s arguments."""

    enabled: bool = True
    """Offload saved activations at all (False: they stay on the device)."""
    tier: Literal["cpu", "nvme"] = "cpu"
    """``"cpu"`` (pinned host memory) or ``"nvme"`` (needs store.nvme_bytes and nvme_dir)."""
    num_layers: int | None = None
    """Offload the first N blocks, in [0, n_layers); None: chosen by measurement (``layers="auto"``:
    the blocks whose copies hide behind compute, see ``offload_activations``)."""
    prefetch_depth: int = 1
    """Layers reloaded ahead of the one backward is in (>= 1)."""
    min_offload_bytes: int = 1024
    """Saved tensors smaller than this many bytes stay on the device."""
    offload_weights: bool = False
    """Also offload parameters and buffers that autograd saves."""
    double_buffering: bool = False
    """Reload into two persistent device buffer sets (needs prefetch_depth=1)."""
    max_kept_bytes: int | str | None = None
    """With num_layers null: at most this many bytes of block activations stay on the device
    (``"8GiB"``); null: bounded by the device memory left unused (CUDA) or not at all (CPU)."""

    def __post_init__(self) -> None:
        if self.max_kept_bytes is not None:
            self.max_kept_bytes = parse_bytes(self.max_kept_bytes, "activations.max_kept_bytes")
            if self.num_layers is not None:
                raise ValueError(f"activations.max_kept_bytes bounds the automatic choice of "
                                 f"layers; with activations.num_layers={self.num_layers} set it "
                                 f"to null (or set num_layers to null)")
        _check_choice("activations.enabled", self.enabled, (True, False))
        _check_choice("activations.tier", self.tier, ("cpu", "nvme"))
        if self.num_layers is not None:
            _check_number("activations.num_layers", self.num_layers, low=0, integer=True)
        _check_number("activations.prefetch_depth", self.prefetch_depth, low=1, integer=True)
        _check_number("activations.min_offload_bytes", self.min_offload_bytes, low=0, integer=True)
        _check_choice("activations.offload_weights", self.offload_weights, (True, False))
        _check_choice("activations.double_buffering", self.double_buffering, (True, False))
        if self.double_buffering and self.prefetch_depth != 1:
            raise ValueError(f"activations.double_buffering=True needs activations."
                             f"prefetch_depth=1 (got {self.prefetch_depth}): two buffer sets hold "
                             f"the layer in use and the one loading")

    def kwargs(self) -> dict:
        """Keyword arguments for ``offload_activations`` (everything but blocks and store)."""
        out = dataclasses.asdict(self)
        del out["enabled"]
        return out


@dataclass(kw_only=True)
class TrainConfig:
    """The ``train`` section: the loop of examples/train_gpt.py and ``tiermem demo``."""

    steps: int = 30
    """Optimizer steps."""
    micro_batch: int = 8
    """Sequences per micro-batch."""
    grad_accumulation_steps: int = 1
    """Micro-batches (backward passes) per optimizer step."""
    seq_len: int | None = None
    """Tokens per sequence; None: the model's ``seq_len``."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype. float32 compares bit-for-bit with the baseline; bfloat16 keeps fp32
    masters in the optimizer, and the two runs' losses drift apart by rounding (float16 would
    need loss scaling and is not offered)."""
    device: str = "auto"
    """``"auto"`` (CUDA if present), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""
    seed: int = 0
    """Seed of the model init and of the data."""
    checkpoint: bool = False
    """Run each block under activation checkpointing (both runs)."""
    baseline: bool = True
    """After the offloaded run, train the same model without offload and compare."""
    tolerance: float = 1e-6
    """Largest accepted |loss difference| against the baseline (absolute)."""
    markov_branching: int = 4
    """Likely successors per token in the generated Markov chain (lower: easier to learn)."""
    log_every: int = 1
    """Print the per-step line every N steps (0: never)."""
    progress: bool = True
    """Show a tqdm progress bar."""

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("micro_batch", 1), ("grad_accumulation_steps", 1),
                          ("seed", 0), ("markov_branching", 1),
                          ("log_every", 0)):
            _check_number(f"train.{name}", getattr(self, name), low=low, integer=True)
        if self.seq_len is not None:
            _check_number("train.seq_len", self.seq_len, low=1, integer=True)
        _check_choice("train.dtype", self.dtype, DTYPES)
        if not (self.device in ("auto", "cpu") or re.fullmatch(r"cuda(:\d+)?", str(self.device))):
            raise ValueError(f"train.device={self.device!r} is not 'auto', 'cpu', 'cuda' or 'cuda:N'")
        for name in ("checkpoint", "baseline", "progress"):
            _check_choice(f"train.{name}", getattr(self, name), (True, False))
        _check_number("train.tolerance", self.tolerance, low=0.0)
