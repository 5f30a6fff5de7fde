"""The spill space's private directory, used through a descriptor (Note [spill dir by fd]).

Note [spill dir by fd]: the private directory ``tiermem-<pid>-<random>`` lives inside
``nvme_dir``, whose owner (maybe another user) can rename it away and plant a look-alike at
its path at any time. Nothing is therefore done by path after the directory is made: it is
opened once (``O_DIRECTORY | O_NOFOLLOW``) and checked to be a directory of this user with mode
0700, files in it are opened relative to that descriptor (``dir_fd``), every I/O backend
transfers through descriptors it opened once (never reopening the path per request), and
removal unlinks tiermem's own files through the descriptor. Only the final ``rmdir`` needs the
path; it runs only while the path still names the directory made (same device and inode), else
the swap is logged naming the path and the planted directory is left alone (a renamed-away
original, emptied, stays where it was moved). A swap between that check and the ``rmdir`` can
at worst remove an empty directory: ``rmdir`` never removes contents.
"""

from __future__ import annotations

import os
import stat

from tiermem._leftovers import MARKER_NAME, remove_owned_dir
from tiermem._log import logger


class PrivateDir:
    """A private directory this process made, held open by descriptor.

    Args:
        path: the directory just made by :func:`tiermem._leftovers.make_owned_dir`.

    Raises:
        OSError: it cannot be opened, or is not a directory of this user with mode 0700 (then
            it is left alone: it is not the one made); the message names the path.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        st = os.fstat(self.fd)
        if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid()
                or stat.S_IMODE(st.st_mode) != 0o700):
            os.close(self.fd)
            self.fd = -1
            raise OSError(f"{path} is not this user's private directory (uid {st.st_uid}, mode "
                          f"{stat.S_IMODE(st.st_mode):o}) right after it was made: another "
                          f"user replaced it; use an nvme_dir only you can write")
        self.ident = (st.st_dev, st.st_ino)

    def open(self, name: str, flags: int, mode: int = 0o600) -> int:
        """``os.open`` of ``name`` inside this directory (relative to its descriptor).

        Raises:
            OSError: as ``os.open``.
        """
        return os.open(name, flags, mode, dir_fd=self.fd)

    def same_file(self, fd: int, other_fd: int) -> bool:
        """Whether two descriptors name the same file (device and inode)."""
        a, b = os.fstat(fd), os.fstat(other_fd)
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    def remove(self, names: tuple[str, ...]) -> None:
        """Unlink ``names`` and the marker through the descriptor, then remove the directory
        if its path still names it (Note [spill dir by fd]); close the descriptor. Best
        effort: failures are logged."""
        if self.fd < 0:
            return
        for name in (*names, MARKER_NAME):
            try:
                os.unlink(name, dir_fd=self.fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("tiermem: cannot remove %s: %s", os.path.join(self.path, name), exc)
        try:
            st = os.lstat(self.path)
            here = (st.st_dev, st.st_ino) == self.ident
        except OSError:
            here = False
        if here:
            remove_owned_dir(self.path, ())
        else:
            logger.warning("tiermem: the spill directory %s was replaced (renamed away, something "
                           "else put in its place); tiermem removed its own files through its "
                           "descriptor and left what is at that path alone", self.path)
        self.close()

    def close(self) -> None:
        """Close the descriptor (idempotent); the directory stays."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
