"""The errors of :mod:`tiermem.checkpoint` (importable from there)."""

from __future__ import annotations

import os


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be used: not a tiermem checkpoint, wrong kind, bad structure.

    ``path`` is the file.
    """

    def __init__(self, message: str, path: str | os.PathLike | None = None) -> None:
        super().__init__(message)
        self.path = None if path is None else os.fspath(path)


class CheckpointCorruption(CheckpointError):
    """The file is truncated or its bytes do not match their SHA-256 (a torn or damaged write)."""


class UnsafeCheckpointError(CheckpointError):
    """The file holds objects that ``torch.load(weights_only=True)`` refuses to unpickle."""


class CheckpointMismatch(CheckpointError, ValueError):
    """The checkpoint does not fit the model or optimizer given to :func:`load_checkpoint`
    (other shapes, keys, param groups); raised before either is touched (Note [checkpoint
    fit]). A ``RuntimeError`` as torch's error for a model is, and a ``ValueError`` as an
    optimizer's is."""
