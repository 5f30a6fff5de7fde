"""Files a user names on a command line: config files and spill directories.

- :func:`config_error` turns what reading a ``--config`` file can raise (a directory, a missing
  or unreadable file, broken YAML) into one line naming the file, what is wrong and the fix.
- :func:`make_private_dir` creates a missing spill directory with mode 0700 (the spill files
  hold training state: other users must not read them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import yaml

logger = logging.getLogger("tiermem")

CONFIG_ERRORS = (OSError, UnicodeDecodeError, yaml.YAMLError)
"""Exceptions reading a config file can raise besides the library's ``ValueError``s."""


def config_error(flag: str, path: str | os.PathLike, exc: BaseException) -> str:
    """One line saying why the config file ``path`` (given as ``flag``) cannot be used.

    Args:
        flag: the option that named the file, e.g. ``"--config"``.
        path: the file.
        exc: what reading or parsing it raised (one of :data:`CONFIG_ERRORS`, or anything else,
            which is described by its message).

    Returns:
        ``"--config=PATH: <what is wrong>; fix: <what to do>"``, without newlines.
    """
    where = f"{flag}={os.fspath(path)!r}"
    if isinstance(exc, IsADirectoryError) or (isinstance(exc, OSError) and os.path.isdir(path)):
        return f"{where} is a directory; fix: name a YAML file (e.g. examples/configs/cpu.yaml)"
    if isinstance(exc, FileNotFoundError):
        return f"{where} does not exist ({exc.strerror or 'No such file'}); fix: check the path"
    if isinstance(exc, PermissionError):
        return f"{where} cannot be read (permission denied); fix: check its permissions"
    if isinstance(exc, UnicodeDecodeError):
        return f"{where} is not a text file ({exc.reason}); fix: name a YAML file"
    if isinstance(exc, yaml.YAMLError):
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        return f"{where} is not valid YAML: {problem}{at}; fix: correct the file there"
    text = " ".join(str(exc).split())
    return f"{where}: {type(exc).__name__}: {text}"


def make_private_dir(path: str | os.PathLike, field: str,
                     log: Callable[[str], object] | None = None) -> bool:
    """Create the directory ``path`` (and missing parents) if it does not exist; the directory
    itself gets mode 0700. An existing directory is left as it is.

    Args:
        path: the directory.
        field: the option or config field that named it, for messages (``"--dir"``,
            ``"store.nvme_dir"``).
        log: where to say that it was created (None: the ``tiermem`` logger, INFO).

    Returns:
        True when it was created, False when it existed.

    Raises:
        ValueError: ``path`` exists and is not a directory, or cannot be created (the message
            names ``field``, the path, why, and the fix).
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        return False
    if os.path.lexists(path):
        raise ValueError(f"{field}={path!r} exists and is not a directory; fix: name a "
                         f"directory (it is created if missing)")
    try:
        os.makedirs(path, mode=0o700)
        os.chmod(path, 0o700)  # makedirs' mode is filtered by the umask
    except FileExistsError:  # made meanwhile by someone else: fine if it is a directory
        if not os.path.isdir(path):
            raise ValueError(f"{field}={path!r} exists and is not a directory; fix: name a "
                             f"directory") from None
        return False
    except OSError as exc:
        raise ValueError(f"{field}={path!r} does not exist and cannot be created "
                         f"({exc.strerror or exc}); fix: create it or pick a writable "
                         f"location") from None
    message = f"created {field} directory {path} (mode 0700)"
    if log is None:
        logger.info(message)
    else:
        log(message)
    return True
