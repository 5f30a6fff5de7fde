"""Crash-safe checkpoints of a model, an optimizer and a :class:`~tiermem.TierStore`.

Writing (:func:`atomic_save`, used by :func:`save_checkpoint` and :func:`save_store`), after the
payload is checked against the loader (Note [checkpoint payload types]), works relative to
directory descriptors (Note [checkpoint directory fds], :mod:`tiermem._ckpt_dir`). A non-empty
regular file at the target that does not end with the trailer below is not tiermem's and is
never replaced (``FileExistsError``). Then:

1. a private temporary directory ``.<name>.tiermem-tmp-<pid>-<random>`` (0700, checked through
   its descriptor to be this user's) is made in the target's directory, holding a marker file
   (pid, process start time, random id; see :mod:`tiermem._leftovers`), and in it the file
   ``data`` is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600 (``mkdir`` never
   follows or reuses a planted name);
2. ``torch.save`` writes the payload into it while a SHA-256 of the bytes is computed on the
   fly; a 48-byte trailer (magic, payload length, digest) is appended;
3. the file is flushed, ``fsync``-ed and read back by the loader (``mmap``), then
   ``os.replace``-d onto the target (atomic on POSIX: same filesystem) once the temporary name
   is checked to still lead to the directory written, and the target's name is checked to lead
   to the file written; the temporary directory (now holding only the marker) is removed;
4. the directory is ``fsync``-ed so the rename itself is durable.

A process killed at any point before step 3 leaves the previous checkpoint untouched (plus a
temporary directory, which :func:`load_checkpoint` never looks at and :func:`cleanup_temp_files`
removes once its writer is dead, if its marker shows tiermem made it and it holds nothing else);
killed after step 3, the new checkpoint is complete.

Reading (:func:`load_checkpoint`, :func:`load_store`) checks the trailer and the digest before
unpickling anything, so a truncated or bit-flipped file raises :class:`CheckpointCorruption`
naming the file instead of returning wrong numbers (``torch.load`` itself does not notice a
flipped bit in tensor data). Unpickling uses ``torch.load(weights_only=True)``: tensors,
containers and plain scalars only; a file holding any other object is refused with
:class:`UnsafeCheckpointError` and nothing in it is executed.

File layout: ``[torch.save zip archive][b"TMCKPT\\x00\\x01"][u64 little-endian archive
length][32-byte SHA-256 of the archive]``. The archive is a normal ``torch.save`` file (zip
readers ignore the trailer), but only these functions verify it.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import pickle
import re
import stat
import time
from typing import Any, Hashable

import torch

from tiermem._ckpt_dir import DIR_FLAGS, TempDir, lstat_at, same_file
from tiermem._ckpt_errors import (CheckpointCorruption, CheckpointError,  # noqa: F401 (API)
                                  CheckpointMismatch, UnsafeCheckpointError)
from tiermem._ckpt_fit import (check_model_fits, check_optimizer_accepts,
                               check_optimizer_fits)
from tiermem._ckpt_payload import check_payload, refusal_reason, weights_only_load
from tiermem._leftovers import MARKER_NAME, read_marker, stale_dirs
from tiermem.config import TIERS
from tiermem.store.store import TierFullError

FORMAT_VERSION = 1
_MAGIC = b"TMCKPT\x00\x01"
_TRAILER_BYTES = len(_MAGIC) + 8 + 32
_TMP_TAG = ".tiermem-tmp-"
_TMP_RE = re.compile(r"\.(?P<name>.+)\.tiermem-tmp-(?P<pid>\d+)-(?P<id>[0-9a-f]+)")
_TMP_KIND = "checkpoint-tmp"
_TMP_DATA = "data"
"""The file a save writes inside its temporary directory (then renamed onto the target)."""
_KIND_CHECKPOINT = "tiermem.checkpoint"
_KIND_STORE = "tiermem.store"
_READ_CHUNK = 8 << 20

logger = logging.getLogger("tiermem")


# ---------------------------------------------------------------------------------------------
# atomic writer


class _HashingWriter:
    """File-like wrapper that forwards writes and hashes the bytes (for ``torch.save``)."""

    def __init__(self, f) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.nbytes = 0
        self.error: BaseException | None = None

    def write(self, data) -> int:
        try:
            view = memoryview(data).cast("B")
            self.sha.update(view)
            self.nbytes += view.nbytes
            self._f.write(view)
        except BaseException as exc:
            # torch.save's zip writer turns any error of a write into an unrelated
            # RuntimeError ("unexpected pos") on its way out; keep the real one (ENOSPC, a
            # Ctrl-C's KeyboardInterrupt) for _write_and_replace to raise
            self.error = self.error or exc
            raise
        return view.nbytes

    def flush(self) -> None:
        self._f.flush()


def _fsync_dir(dir_fd: int) -> None:
    """``fsync`` the open directory ``dir_fd`` so a rename in it is durable."""
    try:
        os.fsync(dir_fd)
    except OSError as exc:  # some filesystems cannot fsync a directory; the rename still holds
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise


def _raise_naming(exc: OSError, path: str, doing: str) -> None:
    """Re-raise ``exc`` when it names a path; else raise an ``OSError`` of its errno (and
    subclass) whose one line names the checkpoint ``path`` and what the save was ``doing``. A
    call relative to a directory descriptor names only a bare name (``data``, the temporary
    directory's), or nothing (the marker's write), which does not say which checkpoint failed.

    Raises:
        OSError: always.
    """
    name = exc.filename
    if isinstance(name, (str, bytes, os.PathLike)) and os.path.dirname(os.fsdecode(name)):
        raise exc
    raise OSError(exc.errno, f"{exc.strerror or exc} ({doing} {path})", path) from exc


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """Write ``torch.save(obj)`` (plus an integrity trailer) to ``path`` atomically and durably.

    See the module docstring for the steps. On any error the temporary directory is removed and
    ``path`` is left as it was, unless the error is the directory's ``fsync`` after the rename.

    Raises:
        TypeError: ``obj`` holds an object that :func:`load_checkpoint` would refuse (Note
            [checkpoint payload types]); nothing is written.
        FileNotFoundError: the directory of ``path`` does not exist.
        IsADirectoryError: ``path`` is a directory.
        FileExistsError: ``path`` is a non-empty file that does not end with the trailer (not
            written by tiermem: it is kept); or something already has the temporary
            directory's name (planted).
        OSError: the write, ``fsync`` or rename failed (e.g. ``ENOSPC``); or someone else
            replaced the temporary directory or the checkpoint during the save (``EPERM``,
            Note [checkpoint directory fds]); the message names the file. Only when the
            ``fsync`` of the directory fails (step 4) is the new file already in place, and
            the message says so.
    """
    check_payload(obj, "obj", caller="atomic_save")
    _atomic_write(obj, path)


def _atomic_write(obj: Any, path: str | os.PathLike) -> None:
    """:func:`atomic_save` once ``obj`` is checked (the file is still read back before the
    rename). Every step works relative to directory descriptors: Note [checkpoint directory
    fds]."""
    path = os.fspath(path)
    directory, name = os.path.split(path)
    directory = directory or "."
    if name in ("", ".", ".."):
        raise IsADirectoryError(errno.EISDIR, "checkpoint path is a directory", path)
    try:
        dir_fd = os.open(directory, DIR_FLAGS)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "checkpoint directory does not exist",
                                directory) from None
    try:
        target = lstat_at(dir_fd, name)
        if target is not None and stat.S_ISDIR(target.st_mode):
            raise IsADirectoryError(errno.EISDIR, "checkpoint path is a directory", path)
        if target is not None and stat.S_ISREG(target.st_mode) and target.st_size and \
                not _has_trailer(dir_fd, name):
            raise FileExistsError(errno.EEXIST, "checkpoint path holds a file that is not a "
                                  "tiermem checkpoint (no tiermem trailer at its end): refusing "
                                  "to replace a file tiermem did not write; fix: remove or "
                                  "rename it, or save under another name", path)
        cleanup_temp_files(directory)
        try:
            tmp = TempDir.make(dir_fd, directory, f".{name}{_TMP_TAG}", _TMP_KIND)
        except OSError as exc:  # e.g. ENOSPC or EROFS at mkdir or at the marker's write
            _raise_naming(exc, path, "making the temporary directory of checkpoint")
        try:
            _write_and_replace(obj, tmp, name, path)
        finally:
            tmp.remove((_TMP_DATA,))
        try:
            _fsync_dir(dir_fd)
        except OSError as exc:
            raise OSError(exc.errno, f"checkpoint {path} was written and renamed into place, "
                          f"but the fsync of its directory failed ({exc.strerror or exc}): it "
                          f"loads, but a power loss may bring back the previous one", path
                          ) from exc
    finally:
        os.close(dir_fd)


def _has_trailer(dir_fd: int, name: str) -> bool:
    """Whether the regular file ``name`` in ``dir_fd`` ends with :func:`atomic_save`'s trailer
    (magic and the length of the rest): a file tiermem wrote, which a save may replace. A
    user's file at the checkpoint's path (a typo, a plain ``torch.save`` file) is not."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        if size < _TRAILER_BYTES:
            return False
        end = os.pread(fd, _TRAILER_BYTES, size - _TRAILER_BYTES)
        return end[:len(_MAGIC)] == _MAGIC and \
            int.from_bytes(end[len(_MAGIC):len(_MAGIC) + 8], "little") == size - _TRAILER_BYTES
    finally:
        os.close(fd)


def _write_and_replace(obj: Any, tmp: TempDir, name: str, path: str) -> None:
    """Steps 1 (the file) to 3 of :func:`atomic_save`: ``data`` in ``tmp``, renamed onto
    ``name`` in ``tmp``'s parent (``path`` is for messages); on error ``data`` is removed."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(_TMP_DATA, flags, 0o600, dir_fd=tmp.fd)
    except OSError as exc:  # e.g. ENOSPC: no inode left
        _raise_naming(exc, path, "creating the file of checkpoint")
    try:
        with os.fdopen(fd, "w+b") as f:
            writer = _HashingWriter(f)
            try:
                torch.save(obj, writer)
            except Exception as exc:
                if writer.error is not None and writer.error is not exc:
                    raise writer.error from exc
                raise
            f.write(_MAGIC + writer.nbytes.to_bytes(8, "little") + writer.sha.digest())
            f.flush()
            os.fsync(f.fileno())
            _check_readable(f, path)
            tmp.check_in_place(path)  # Note [checkpoint directory fds], step 4
            os.replace(_TMP_DATA, name, src_dir_fd=tmp.fd, dst_dir_fd=tmp.parent_fd)
            # step 5, while f is open (its inode cannot be freed and reused meanwhile)
            now = lstat_at(tmp.parent_fd, name)
            if now is None or not same_file(now, os.fstat(f.fileno())):
                raise OSError(errno.EPERM, f"checkpoint {path} is not the file this save wrote "
                              f"right after renaming it there: someone else can write "
                              f"{os.path.dirname(path) or '.'}; save into a directory only "
                              f"you can write", path)
    except BaseException as exc:
        try:
            os.unlink(_TMP_DATA, dir_fd=tmp.fd)
        except OSError:
            pass
        if isinstance(exc, OSError):
            _raise_naming(exc, path, "writing checkpoint")
        raise


def _check_readable(f, path: str) -> None:
    """Read the written file ``f`` back with the loader itself before it replaces ``path``
    (step 2 of Note [checkpoint payload types]): through ``/proc/self/fd`` and ``mmap`` where
    they exist, so tensor bytes are not read; else through ``f`` (all of it).

    Raises:
        TypeError: the loader refuses an object in the file (names ``path`` and the object).
    """
    f.seek(0)
    proc = f"/proc/self/fd/{f.fileno()}"
    try:
        try:
            weights_only_load(proc, mmap=True) if os.path.exists(proc) else weights_only_load(f)
        except (OSError, RuntimeError) as exc:  # no mmap on this filesystem: read it all
            logger.debug("tiermem: checking %s without mmap (%s)", path, exc)
            f.seek(0)
            weights_only_load(f)
    except pickle.UnpicklingError as exc:
        reason = refusal_reason(exc)
        raise TypeError(f"cannot save checkpoint {path}: it would hold an object that "
                        f"load_checkpoint would refuse (torch.load(weights_only=True): "
                        f"{reason}); the previous checkpoint was kept; fix: save only tensors, "
                        f"dicts, lists, tuples, sets, str, int, float, bool or None") from None


# ---------------------------------------------------------------------------------------------
# verified reader


def _verify(f, path: str) -> None:
    """Check the trailer and the SHA-256 of the archive in the open file ``f``.

    Raises:
        CheckpointCorruption: truncated, damaged, or not written by :func:`atomic_save`.
    """
    size = os.fstat(f.fileno()).st_size
    if size < _TRAILER_BYTES:
        raise CheckpointCorruption(
            f"checkpoint {path} is truncated or not a tiermem checkpoint ({size} bytes, "
            f"smaller than its trailer)", path)
    f.seek(size - _TRAILER_BYTES)
    trailer = f.read(_TRAILER_BYTES)
    magic, length, digest = trailer[:8], int.from_bytes(trailer[8:16], "little"), trailer[16:]
    if magic != _MAGIC:
        raise CheckpointCorruption(
            f"checkpoint {path} is truncated, damaged or not written by tiermem.checkpoint "
            f"(no trailer at its end)", path)
    if length != size - _TRAILER_BYTES:
        raise CheckpointCorruption(
            f"checkpoint {path} is damaged: the trailer says {length} bytes of data, the file "
            f"holds {size - _TRAILER_BYTES}", path)
    f.seek(0)
    sha = hashlib.sha256()
    left = length
    while left:
        block = f.read(min(_READ_CHUNK, left))
        if not block:
            raise CheckpointCorruption(f"checkpoint {path} is truncated (short read)", path)
        sha.update(block)
        left -= len(block)
    if sha.digest() != digest:
        raise CheckpointCorruption(
            f"checkpoint {path} is corrupted: SHA-256 mismatch (the bytes changed after they "
            f"were written); use an older checkpoint", path)


_FILE_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _open_regular(path: str):
    """Open ``path`` for reading without blocking on a FIFO (``O_NONBLOCK``), and only if
    ``fstat`` says it is a regular file.

    Raises:
        FileNotFoundError: nothing at ``path``.
        IsADirectoryError: ``path`` is a directory.
        CheckpointError: ``path`` is a FIFO, socket or device (names it and what it is).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "no checkpoint at this path", path) from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "checkpoint path is a directory", path)
        if not stat.S_ISREG(mode):
            what = next((name for test, name in _FILE_KINDS if test(mode)), "not a file")
            raise CheckpointError(f"checkpoint {path} is not a regular file (it is {what}); "
                                  f"name the checkpoint file itself", path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _load_verified(path: str | os.PathLike, kind: str, verify: bool = True) -> dict:
    """Open ``path`` once, verify it (``verify``), ``torch.load(weights_only=True)`` it from
    the same open file (a concurrent save renaming a new file over ``path`` cannot slip in
    between), and check its format tag and version."""
    path = os.fspath(path)
    with _open_regular(path) as f:
        if verify:
            _verify(f, path)
        f.seek(0)
        try:
            payload = weights_only_load(f)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"checkpoint {path} was refused: it holds objects other than tensors, "
                f"containers and plain scalars, which torch.load(weights_only=True) does not "
                f"unpickle ({str(exc).splitlines()[0]}); only load files you trust with other "
                f"tools", path) from exc
        except (RuntimeError, EOFError, ValueError, KeyError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise CheckpointCorruption(f"checkpoint {path} cannot be read: "
                                       f"{type(exc).__name__}: {first}", path) from exc
    if not isinstance(payload, dict) or payload.get("format") != kind:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(f"{path} is not a {kind} file (format: {found!r})", path)
    if payload.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has {kind} format version {payload.get('version')!r}; "
                              f"this tiermem reads version {FORMAT_VERSION}", path)
    return payload


# ---------------------------------------------------------------------------------------------
# temporary files


def cleanup_temp_files(directory: str | os.PathLike) -> list[str]:
    """Remove the temporary directories of interrupted saves in ``directory``.

    A directory ``.<name>.tiermem-tmp-<pid>-<id>`` is removed only when a save made it (a real
    directory of this user whose marker agrees with its name, holding nothing but the marker
    and ``data``, see :mod:`tiermem._leftovers`) and its writer is gone: the pid is dead, or it
    now belongs to a process with another start time. Those of live writers (this process
    included), look-alike names without a marker (a user's ``.notes.tiermem-tmp-1-ab``) and
    directories holding anything else are left alone. Called by every save for its directory.

    Removal goes through descriptors (Note [checkpoint directory fds]): each directory found is
    opened with ``O_NOFOLLOW`` and checked again through its descriptor (this user's, its
    marker agrees with its name, nothing else in it) before ``data`` and the marker are
    unlinked in it, so one swapped for a link meanwhile is left alone.

    Returns:
        The paths removed.
    """
    removed: list[str] = []
    stale = stale_dirs(directory, _TMP_RE, _TMP_KIND, (_TMP_DATA,))
    if not stale:
        return removed
    try:
        dir_fd = os.open(directory, DIR_FLAGS)
    except OSError:
        return removed
    try:
        for path in stale:
            tmp = _open_stale(dir_fd, os.fspath(directory), os.path.basename(path))
            if tmp is not None and tmp.remove((_TMP_DATA,)):
                removed.append(path)
    finally:
        os.close(dir_fd)
    return removed


def _open_stale(dir_fd: int, directory: str, name: str) -> TempDir | None:
    """The temporary directory ``name`` of a dead writer, opened (``O_NOFOLLOW``) and checked
    through its descriptor; None when it is not (or no longer) one."""
    try:
        fd = os.open(name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return None  # gone, or a link now
    try:
        m = _TMP_RE.fullmatch(name)
        owner = read_marker(name, dir_fd=fd)
        inside = set(os.listdir(fd))
        agrees = owner is not None and (owner.kind, str(owner.pid), owner.id) == (
            _TMP_KIND, m.group("pid"), m.group("id")) and inside <= {MARKER_NAME, _TMP_DATA}
        unfinished = owner is None and (not inside or inside == {MARKER_NAME} and os.stat(
            MARKER_NAME, dir_fd=fd, follow_symlinks=False).st_size == 0)  # killed before it
        if os.fstat(fd).st_uid == os.geteuid() and (agrees or unfinished):
            return TempDir(dir_fd, directory, name, fd)
    except OSError:
        pass
    os.close(fd)
    return None


# ---------------------------------------------------------------------------------------------
# model + optimizer checkpoints


def save_checkpoint(path: str | os.PathLike, *, model: torch.nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None, extra: Any = None) -> None:
    """Save ``model.state_dict()``, ``optimizer.state_dict()`` and ``extra`` to ``path``,
    crash-safely (see the module docstring).

    ``extra`` must hold only what ``torch.load(weights_only=True)`` accepts: tensors, dicts,
    lists, tuples, sets, str, int, float, bool, None (e.g. the step, an LR scheduler's
    ``state_dict()``, a loss history); so must the two state dicts. Anything else (a numpy
    scalar, ``argparse.Namespace``, ``pathlib.Path``...) is refused before anything is written
    (Note [checkpoint payload types]).

    The optimizer's state is taken first, and the model's after it: a HybridAdam step still in
    flight (``param_sync="forward"``) is completed by the former, so both hold that step. A
    save of the model alone cannot see such a step: call ``opt.synchronize()`` before it
    (Note [forward sync]), or the parameters are saved while its worker still writes them.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``optimizer`` has no ``state_dict``; or
            the payload holds an object :func:`load_checkpoint` would refuse (the message names
            its key path, e.g. ``extra['args']``, its type and the fix); the previous
            checkpoint at ``path`` is untouched.
        FileExistsError: ``path`` holds a file tiermem did not write (not replaced).
        OSError: the write failed, or someone else changed the directory during the save
            (Note [checkpoint directory fds]); the previous checkpoint at ``path`` is untouched
            unless the change came after the rename.
    """
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"save_checkpoint: model must be a torch.nn.Module, "
                        f"got {type(model).__name__}")
    if optimizer is not None and not callable(getattr(optimizer, "state_dict", None)):
        raise TypeError(f"save_checkpoint: optimizer must have a state_dict() method, "
                        f"got {type(optimizer).__name__}")
    # the optimizer's first: HybridAdam's state_dict() completes a step still in flight
    # (param_sync="forward", Note [forward sync]), so the model's is taken from its result
    opt_state = optimizer.state_dict() if optimizer is not None else None
    payload = {
        "format": _KIND_CHECKPOINT, "version": FORMAT_VERSION, "time": time.time(),
        "model": model.state_dict() if model is not None else None,
        "optimizer": opt_state,
        "extra": extra,
    }
    for part, label in (("model", "model.state_dict()"),
                        ("optimizer", "optimizer.state_dict()"), ("extra", "extra")):
        check_payload(payload[part], label)
    _atomic_write(payload, path)


def load_checkpoint(path: str | os.PathLike, *, model: torch.nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None, strict: bool = True,
                    verify: bool = True) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` (never unpickling other objects).

    The file is verified (trailer and SHA-256; ``verify=False`` skips the digest) and fully
    read, and checked to fit ``model`` and ``optimizer`` (Note [checkpoint fit]: keys with
    ``strict``, shapes, param groups), before either is touched; then
    ``model.load_state_dict(..., strict=strict)`` and ``optimizer.load_state_dict(...)`` run,
    and errors only they find propagate unchanged (those of the optimizer come after the model
    was loaded). Tensors are loaded on the CPU; the model and optimizer copy them to their
    devices.

    Returns:
        ``{"model": state_dict | None, "optimizer": state_dict | None, "extra": ..., "time":
        seconds since the epoch of the save, "format", "version"}``.

    Raises:
        FileNotFoundError: no file at ``path`` (temporary files of interrupted saves are never
            used instead).
        IsADirectoryError: ``path`` is a directory.
        CheckpointCorruption: truncated or damaged file (names the file).
        UnsafeCheckpointError: the file holds arbitrary (non-weights) objects.
        CheckpointError: a tiermem store snapshot or another file type; ``path`` is not a
            regular file (a FIFO, socket or device: refused at once, never read); or ``model``
            / ``optimizer`` given but the checkpoint has none.
        CheckpointMismatch: the checkpoint does not fit ``model`` or ``optimizer`` (one line
            naming the file, the first key or param and both shapes); neither was touched.
        RuntimeError, ValueError: from ``load_state_dict`` of the model / optimizer.
    """
    payload = _load_verified(path, _KIND_CHECKPOINT, verify)
    for name, obj in (("model", model), ("optimizer", optimizer)):
        if obj is not None and payload.get(name) is None:
            raise CheckpointError(f"checkpoint {os.fspath(path)} has no {name} state, but a "
                                  f"{name} was given to load_checkpoint", path)
    if model is not None:
        check_model_fits(os.fspath(path), model, payload["model"], strict)
    if optimizer is not None:
        check_optimizer_fits(os.fspath(path), optimizer, payload["optimizer"])
        check_optimizer_accepts(os.fspath(path), optimizer, payload["optimizer"])
    if model is not None:
        model.load_state_dict(payload["model"], strict=strict)
    if optimizer is not None:
        optimizer.load_state_dict(payload["optimizer"])
    return payload




# ---------------------------------------------------------------------------------------------
# TierStore snapshots


def _valid_key(key: Any) -> bool:
    if isinstance(key, bool):
        return False
    if isinstance(key, (str, int)):
        return True
    return isinstance(key, tuple) and all(_valid_key(k) for k in key)


def save_store(store, path: str | os.PathLike) -> dict[Hashable, str]:
    """Save every key of ``store`` with its tensor and tier to ``path``, crash-safely.

    Each tensor is read through the store's ``"cpu"`` tier (keys in ``"nvme"`` are read back,
    copied and spilled again, so placement is unchanged) and copied into host memory: the
    snapshot needs host RAM for all of the store's bytes while it is written. Do not modify the
    store from other threads during the save; a key deleted meanwhile is skipped.

    Returns:
        ``{key: tier}`` of what was saved.

    Raises:
        TypeError: a key that is not str / int / a tuple of them (nothing is written).
        TierFullError: a spilled key cannot be staged through a full ``"cpu"`` tier.
        SpillError, SpillCorruption: a spilled key cannot be read back.
        FileExistsError: ``path`` holds a file tiermem did not write (not replaced).
        OSError: the write failed (the previous file at ``path`` is untouched).
    """
    keys = store.keys()
    for key in keys:
        if not _valid_key(key):
            raise TypeError(f"save_store: key {key!r} cannot be saved; store snapshots take keys "
                            f"that are str, int or (nested) tuples of them")
    entries, tiers = [], {}
    for key in keys:
        try:
            tier = store.tier_of(key)
            tensor = store.get(key, "cpu", hold=True)
        except KeyError:
            continue  # deleted by another thread meanwhile
        try:
            copy = tensor.to("cpu", copy=True)
        finally:
            store.release(key)
        if tier == "nvme":
            store.evict(key, "nvme").wait()
        entries.append({"key": key, "tier": tier, "tensor": copy})
        tiers[key] = tier
    _atomic_write({"format": _KIND_STORE, "version": FORMAT_VERSION, "time": time.time(),
                   "entries": entries}, path)  # keys checked above; entries hold tensors
    return tiers


def load_store(path: str | os.PathLike, store, *, verify: bool = True) -> dict[Hashable, str]:
    """Put every tensor of a :func:`save_store` file back into ``store`` (replacing keys).

    Each key goes into its saved tier when that tier can take it, else into the fastest tier
    that can (``put(tier=None)``); a key already in the store is replaced.

    Returns:
        ``{key: tier}`` where each key was placed.

    Raises:
        FileNotFoundError, CheckpointCorruption, UnsafeCheckpointError, CheckpointError: as
            :func:`load_checkpoint` (nothing is put into the store then).
        TierFullError: a tensor fits in no tier of ``store``; keys put before it stay.
    """
    payload = _load_verified(path, _KIND_STORE, verify)
    entries = payload.get("entries")
    if not isinstance(entries, list):
        raise CheckpointError(f"store snapshot {os.fspath(path)} has no list of entries", path)
    for i, e in enumerate(entries):
        if not (isinstance(e, dict) and _valid_key(e.get("key")) and e.get("tier") in TIERS
                and isinstance(e.get("tensor"), torch.Tensor)):
            raise CheckpointError(f"store snapshot {os.fspath(path)}: entry {i} is malformed "
                                  f"(needs a str/int/tuple key, a tier in {TIERS} and a "
                                  f"tensor)", path)
    placed = {}
    for e in entries:
        key, tier, tensor = e["key"], e["tier"], e["tensor"]
        try:
            store.put(key, tensor, tier=tier)
        except TierFullError:
            store.put(key, tensor)  # any tier; raises TierFullError naming all tiers
        placed[key] = store.tier_of(key)
    return placed


__all__ = ["CheckpointCorruption", "CheckpointError", "CheckpointMismatch",
           "UnsafeCheckpointError", "atomic_save", "cleanup_temp_files", "load_checkpoint",
           "load_store", "save_checkpoint", "save_store"]

