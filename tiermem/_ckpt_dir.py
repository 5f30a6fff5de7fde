"""A save's private temporary directory, held by its descriptor (for :mod:`tiermem.checkpoint`).

Note [checkpoint directory fds]
A checkpoint's directory may be writable by someone else (a shared scratch directory, another
user's project directory). Whoever can write it can rename any entry in it, our temporary
directory included, and put a symlink in its place; a save that then used the name
``<dir>/.<name>.tiermem-tmp-<pid>-<id>/data`` would follow the link (``O_NOFOLLOW`` guards only
the last component), and ``os.replace`` would move some other file of this user onto the
checkpoint. So a save:

1. opens the checkpoint's directory once (``O_DIRECTORY``; links in the path the user gave are
   followed, that is the user's choice) and does everything relative to that descriptor;
2. makes the temporary directory with ``mkdir(dir_fd=...)`` (which never follows or reuses a
   planted name), opens it with ``O_NOFOLLOW | O_DIRECTORY`` and checks with ``fstat`` that it
   is a directory of this user with mode 0700 (``fchmod`` where the umask dropped bits);
3. creates ``data`` and the marker relative to the temporary directory's descriptor, so the
   bytes land in the directory it made whatever its name now leads to;
4. before the rename checks that the temporary name still leads to that directory (same device
   and inode, not followed) and raises naming both paths if not: the previous checkpoint is
   untouched, and the save does not report success in a directory someone is tampering with;
5. renames ``data`` with ``src_dir_fd``/``dst_dir_fd`` and checks that the checkpoint's name
   now leads to the file it wrote (same device and inode); else it raises naming the path;
6. removes ``data`` and the marker through the temporary directory's descriptor and the
   directory by name only while the name still leads to it (else it is left, logged).

What a save cannot prevent: someone who can write the directory can rename or delete the
checkpoint after the save (0600 keeps them from reading it). Save into a directory only you
can write.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat

from tiermem._leftovers import MARKER_NAME, Owner, _pid_start_time, write_marker

logger = logging.getLogger("tiermem")

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
"""Flags to open a directory for ``*at`` calls (``O_NOFOLLOW`` added where a link is refused)."""


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    """Whether two ``stat`` results are of the same file (device and inode)."""
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    """``lstat`` of ``name`` in the open directory ``dir_fd`` (None: nothing there)."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


class TempDir:
    """``<dir>/<prefix><pid>-<random id>`` made and held open by :meth:`make`; ``fd`` is its
    descriptor, ``name`` its name in the parent, ``path`` that name joined to the parent's path
    (for messages)."""

    def __init__(self, parent_fd: int, parent_path: str, name: str, fd: int) -> None:
        self.parent_fd, self.name, self.fd = parent_fd, name, fd
        self.path = os.path.join(parent_path, name)
        self._stat = os.fstat(fd)

    @classmethod
    def make(cls, parent_fd: int, parent_path: str, prefix: str, kind: str) -> TempDir:
        """Steps 2 and 3 (marker) of Note [checkpoint directory fds].

        Raises:
            FileExistsError: something already has the name (e.g. a planted symlink).
            OSError: the new directory is not this user's private directory (names it).
        """
        token = secrets.token_hex(4)
        name = f"{prefix}{os.getpid()}-{token}"
        path = os.path.join(parent_path, name)
        os.mkdir(name, 0o700, dir_fd=parent_fd)
        try:
            fd = os.open(name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
        except OSError as exc:  # replaced between mkdir and open: leave it, say so
            raise OSError(exc.errno, f"the temporary directory {path} was replaced right after "
                          f"it was made ({exc.strerror}); someone else can write "
                          f"{parent_path}", path) from exc
        tmp = cls(parent_fd, parent_path, name, fd)
        try:
            st = tmp._stat
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                raise OSError(errno.EPERM, f"the temporary directory {path} is not this user's "
                              f"directory after mkdir; someone else can write {parent_path}",
                              path)
            if stat.S_IMODE(st.st_mode) != 0o700:  # the umask may have dropped bits
                os.fchmod(fd, 0o700)
                if stat.S_IMODE(os.fstat(fd).st_mode) != 0o700:
                    raise OSError(errno.EPERM, f"cannot make {path} private (mode 0700)", path)
            write_marker(path, Owner(kind, os.getpid(), _pid_start_time(os.getpid()), token),
                         dir_fd=fd)
        except BaseException:
            tmp.remove(())
            raise
        return tmp

    def check_in_place(self, target: str) -> None:
        """Step 4 of Note [checkpoint directory fds] before renaming onto ``target``.

        Raises:
            OSError: the name no longer leads to this directory (names it and ``target``).
        """
        now = lstat_at(self.parent_fd, self.name)
        if now is None or not stat.S_ISDIR(now.st_mode) or not same_file(now, self._stat):
            what = "removed" if now is None else \
                "a symlink" if stat.S_ISLNK(now.st_mode) else "another file"
            parent = os.path.dirname(self.path)
            raise OSError(errno.EPERM, f"the temporary directory {self.path} was replaced "
                          f"during the save (now {what}): someone else can write {parent}; "
                          f"nothing was renamed onto the checkpoint {target} (the previous one "
                          f"is untouched); save into a directory only you can write",
                          self.path)

    def remove(self, names: tuple[str, ...]) -> bool:
        """Step 6 of Note [checkpoint directory fds]: unlink ``names`` and the marker through
        the descriptor, ``rmdir`` by name while the name leads here, close. Returns whether
        the directory is gone (anything else in it keeps it; logged)."""
        try:
            for name in (*names, MARKER_NAME):
                try:
                    os.unlink(name, dir_fd=self.fd)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    logger.warning("tiermem: cannot remove %s: %s",
                                   os.path.join(self.path, name), exc)
            now = lstat_at(self.parent_fd, self.name)
            if now is None or not same_file(now, self._stat):
                logger.warning("tiermem: left the temporary directory of a save in place: "
                               "%s was renamed or replaced by someone else during the save",
                               self.path)
                return False
            try:
                os.rmdir(self.name, dir_fd=self.parent_fd)
            except OSError as exc:
                logger.warning("tiermem: left %s in place: %s", self.path, exc.strerror or exc)
                return False
            return True
        finally:
            os.close(self.fd)
