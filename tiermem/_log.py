"""tiermem's logger, the command line's handler for it, and progress bars.

Library code logs on ``logging.getLogger("tiermem")``: backend choices and where work goes at
INFO, fallbacks (native kernel missing, checksums on zlib's CRC-32) and disagreements (a cost
model off by more than 2x) at WARNING. A program that configures no logging still sees the
warnings (Python prints WARNING and above of unconfigured loggers on stderr); the ``tiermem``
command (:func:`configure_cli_logging`) also shows INFO, as ``tiermem: message`` lines on
stderr, so stdout keeps only the command's results.

Progress bars (:func:`progress`) are tqdm bars on stderr that show only when stderr is a
terminal: logs and captured output get no bar characters.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

LOGGER_NAME = "tiermem"

logger = logging.getLogger(LOGGER_NAME)


class _StderrHandler(logging.StreamHandler):
    """A stream handler that writes to whatever ``sys.stderr`` is at the time of each record
    (so it follows pytest's capture and any redirection made after it was installed)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):  # noqa: D401 - a property
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # the base class assigns it; the current stderr wins
        pass


def configure_cli_logging(level: int = logging.INFO) -> None:
    """Show the ``tiermem`` logger's records of ``level`` and above on stderr as one
    ``tiermem: message`` line each (``tiermem: warning: message`` for warnings). Idempotent:
    one handler however often it is called.

    Args:
        level: the lowest level shown (``logging.INFO`` by default).
    """
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(_CliFormatter())
        logger.addHandler(handler)
    logger.setLevel(level)


class _CliFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prefix = "tiermem: " if record.levelno < logging.WARNING else \
            f"tiermem: {record.levelname.lower()}: "
        return prefix + record.getMessage()


def progress(total: int | None = None, desc: str = "", unit: str = "it", **kwargs: Any):
    """A tqdm progress bar on stderr, shown only when stderr is a terminal.

    Args:
        total: the number of units (None: unknown).
        desc: the bar's label.
        unit: what one unit is (``"step"``, ``"chunk"``, ``"setting"``).
        **kwargs: passed to ``tqdm.tqdm``.

    Returns:
        A ``tqdm.tqdm`` (use ``update(n)`` and ``close()``, or as a context manager); when
        stderr is not a terminal it is disabled and prints nothing.
    """
    from tqdm import tqdm  # noqa: PLC0415  (a dependency; imported when a bar is made)

    kwargs.setdefault("leave", False)
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr,
                disable=not _stderr_is_terminal(), **kwargs)


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stream
        return False
