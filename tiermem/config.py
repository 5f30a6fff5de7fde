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
import os
import re
from dataclasses import dataclass
from typing import Any, Literal

import yaml

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
        ValueError: unparsable string, unknown unit, negative or non-integral count.
        TypeError: value is neither a number nor a string.
    """
    if isinstance(value, bool):
        raise TypeError(f"{field} must be a byte count (int or '4GiB'), got bool {value!r}")
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"{field}={value!r} is not a byte size; write an integer number of bytes or a "
                f"number with a unit such as '512MiB' or '4GB'")
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not isinstance(value, (int, float)):
        raise TypeError(f"{field} must be a byte count (int or '4GiB'), got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{field}={value!r} is negative; a budget is a byte count >= 0 "
                         f"(0 disables the tier)")
    if float(value) != int(value):
        raise ValueError(f"{field}={value!r} is not a whole number of bytes")
    return int(value)


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

    def __post_init__(self) -> None:
        for name in ("gpu_bytes", "cpu_bytes", "nvme_bytes", "pool_slab_bytes", "io_chunk_bytes"):
            setattr(self, name, parse_bytes(getattr(self, name), f"StoreConfig.{name}"))
        if self.nvme_bytes > 0 and not self.nvme_dir:
            raise ValueError(
                f"StoreConfig.nvme_bytes={self.nvme_bytes} needs a spill directory: set "
                f"StoreConfig.nvme_dir to a writable directory on an SSD, or nvme_bytes=0")
        if self.nvme_dir is not None:
            self.nvme_dir = os.fspath(self.nvme_dir)
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
