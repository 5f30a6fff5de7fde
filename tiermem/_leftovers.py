"""Directories tiermem makes for itself, and finding those left behind by dead processes.

Spill directories (``tiermem-<pid>-<id>``) and checkpoint temporary directories
(``.<name>.tiermem-tmp-<pid>-<id>``) are made by :func:`make_owned_dir`: ``mkdir`` (0700), then a
marker file ``.tiermem-owner`` (0600) holding the kind, the writer's pid, its start time and the
random ``id`` of the name. Cleanup trusts a name only together with its marker: a directory is
tiermem's when it is this user's, a real directory (not a symlink), its marker is a regular file
of this user that agrees with the name, and it holds nothing but the marker and the names its
kind writes; or it is empty but for an empty marker (its maker died between ``mkdir`` and the
marker's write: there is nothing in it to lose). Anything else that happens to match a pattern
(a user's ``tiermem-20240612-1a/`` holding a file) is never touched, and removal unlinks only
those known names before ``rmdir``, so a file that tiermem did not write keeps its directory
too.

A leftover is stale when its writer is gone: the pid is dead, or it now belongs to a process
whose start time differs from the one in the marker (pid reuse).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import stat
from dataclasses import dataclass

logger = logging.getLogger("tiermem")

MARKER_NAME = ".tiermem-owner"
"""The marker file inside every directory tiermem makes for itself."""
_MAGIC = "tiermem-owner 1"


@dataclass(frozen=True)
class Owner:
    """What a marker says: the directory's ``kind``, its writer's ``pid`` and start time
    (``start``, seconds since the epoch, None where unknown) and the name's random ``id``."""

    kind: str
    pid: int
    start: float | None
    id: str


def _pid_start_time(pid: int) -> float | None:
    """Wall-clock start time of process ``pid`` in seconds (Linux /proc), or None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[19])  # field 22 of stat(5); fields[0] is field 3
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime"))
        return round(btime + ticks / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def write_marker(dir_path: str, owner: Owner, dir_fd: int | None = None) -> None:
    """Create ``dir_path/.tiermem-owner`` (O_EXCL, O_NOFOLLOW, mode 0600) describing ``owner``;
    relative to the open directory ``dir_fd`` when given (then ``dir_path`` is only its name).

    Raises:
        OSError: the marker exists already or cannot be written.
    """
    start = "-" if owner.start is None else repr(owner.start)
    text = f"{_MAGIC}\nkind {owner.kind}\npid {owner.pid}\nstart {start}\nid {owner.id}\n"
    path = os.path.join(dir_path, MARKER_NAME) if dir_fd is None else MARKER_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=dir_fd)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def read_marker(dir_path: str, dir_fd: int | None = None) -> Owner | None:
    """The :class:`Owner` of ``dir_path``'s marker (relative to the open directory ``dir_fd``
    when given), or None when it is missing, not a regular file of this user, or not a tiermem
    marker."""
    path = os.path.join(dir_path, MARKER_NAME) if dir_fd is None else MARKER_NAME
    try:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0)
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > 4096:
            return None
        lines = os.read(fd, 4096).decode("ascii", "replace").splitlines()
    finally:
        os.close(fd)
    try:
        fields = dict(line.split(" ", 1) for line in lines[1:])
        if lines[0] != _MAGIC:
            return None
        start = None if fields["start"] == "-" else float(fields["start"])
        return Owner(fields["kind"], int(fields["pid"]), start, fields["id"])
    except (IndexError, KeyError, ValueError):
        return None


def make_owned_dir(parent: str, prefix: str, kind: str) -> str:
    """Make ``parent/<prefix><pid>-<random id>`` (mode 0700 whatever the umask, checked to be
    this user's directory) with its marker, and return its path.

    Raises:
        OSError: ``mkdir`` failed (it exists: e.g. a planted symlink; permission), or the
            directory is not this user's private directory after it (a race).
    """
    token = secrets.token_hex(4)
    path = os.path.join(parent, f"{prefix}{os.getpid()}-{token}")
    os.mkdir(path, 0o700)
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(f"{path} is not a directory owned by this user after mkdir (race?)")
        if stat.S_IMODE(st.st_mode) != 0o700:  # the umask may have dropped bits
            os.chmod(path, 0o700, follow_symlinks=False)
            if stat.S_IMODE(os.lstat(path).st_mode) != 0o700:
                raise OSError(f"cannot make {path} private (mode 0700)")
        write_marker(path, Owner(kind, os.getpid(), _pid_start_time(os.getpid()), token))
    except BaseException:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():  # never through a link
            remove_owned_dir(path, ())
        raise
    return path


def owner_gone(owner: Owner) -> bool:
    """Whether the process that made a directory has exited (its pid dead, or reused by a
    process that started at another time). This process counts as alive."""
    if owner.pid == os.getpid():
        return False
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, OSError):
        pass  # another user's live process (or an odd pid): its start time decides
    now = _pid_start_time(owner.pid)
    return owner.start is not None and now is not None and abs(now - owner.start) > 0.05


def owned_by_tiermem(path: str, match: re.Match, kind: str, names: tuple[str, ...]) -> Owner | None:
    """The marker's :class:`Owner` when ``path`` (whose name gave ``match``: groups ``pid`` and
    ``id``) is a directory tiermem made of ``kind`` holding only its marker and ``names``;
    else None."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return None
        inside = set(os.listdir(path))
    except OSError:
        return None
    owner = read_marker(path)
    if owner is None and _unfinished(path, inside):
        # killed between mkdir and the marker's write: nothing in it to lose
        return Owner(kind, int(match.group("pid")), None, match.group("id"))
    if owner is None or owner.kind != kind or str(owner.pid) != match.group("pid") \
            or owner.id != match.group("id") or not inside <= {MARKER_NAME, *names}:
        return None
    return owner


def _unfinished(path: str, inside: set) -> bool:
    """Whether ``path`` is empty but for an empty marker of this user (a directory whose maker
    died before writing its marker)."""
    if not inside <= {MARKER_NAME}:
        return False
    if not inside:
        return True
    try:
        st = os.lstat(os.path.join(path, MARKER_NAME))
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_size == 0


def stale_dirs(directory: str | os.PathLike, pattern: re.Pattern, kind: str,
               names: tuple[str, ...]) -> list[str]:
    """Directories in ``directory`` whose names match ``pattern`` (groups ``pid`` and ``id``),
    that tiermem made (:func:`owned_by_tiermem`) and whose writer is gone. An unreadable
    directory gives ``[]``."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    out = []
    for name in entries:
        m = pattern.fullmatch(name)
        if not m:
            continue
        path = os.path.join(os.fspath(directory), name)
        owner = owned_by_tiermem(path, m, kind, names)
        if owner is not None and owner_gone(owner):
            out.append(path)
    return out


def remove_owned_dir(path: str, names: tuple[str, ...]) -> bool:
    """Unlink ``names`` and the marker inside ``path`` (those present), then ``rmdir`` it.

    Anything else in it stays, and then so does the directory (logged). Returns whether the
    directory is gone.
    """
    for name in (*names, MARKER_NAME):
        try:
            os.unlink(os.path.join(path, name))
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("tiermem: cannot remove %s: %s", os.path.join(path, name), exc)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError as exc:
        why = ("it holds files tiermem did not write" if exc.errno in (errno.ENOTEMPTY,
                                                                        errno.EEXIST)
               else "it cannot be removed")  # e.g. EROFS, EACCES: its own files stay too
        logger.warning("tiermem: left %s in place: %s (%s)", path, why, exc.strerror or exc)
        return False
    return True
