"""Finding files and directories left behind by dead tiermem processes.

Spill directories (``tiermem-<pid>-<hex>``) and checkpoint temp files
(``.<name>.tiermem-tmp-<pid>-<hex>``) carry their writer's pid. An entry is stale when it is
this user's, of the expected kind (not a symlink), and its writer is gone: the pid is dead, or
it now belongs to a process that started after the entry was last modified (pid reuse).
"""

from __future__ import annotations

import os
import re
from typing import Callable


def _pid_start_time(pid: int) -> float | None:
    """Wall-clock start time of process ``pid`` in seconds (Linux /proc), or None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[19])  # field 22 of stat(5); fields[0] is field 3
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def owner_alive(pid: int, mtime: float) -> bool:
    """Whether the process that wrote an entry last modified at ``mtime`` (epoch s) may still
    be running; this process and other users' live processes count as alive."""
    if pid == os.getpid():
        return True  # maybe still in use by another thread of this process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # another user's live process (or an odd pid): leave it
    started = _pid_start_time(pid)
    # the pid was reused by a process that started after the entry was last written
    return started is None or mtime >= started - 2.0


def stale_entries(directory: str | os.PathLike, pattern: re.Pattern,
                  is_kind: Callable[[int], bool]) -> list[str]:
    """Paths in ``directory`` whose names match ``pattern`` (its group ``pid`` or group 1 is
    the writer's pid), whose ``lstat`` mode passes ``is_kind`` (e.g. ``stat.S_ISDIR``), owned
    by this user, and whose writer is gone. An unreadable directory gives ``[]``."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    me, out = os.geteuid(), []
    for name in names:
        m = pattern.fullmatch(name)
        if not m:
            continue
        path = os.path.join(os.fspath(directory), name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        pid = int(m.group("pid") if "pid" in pattern.groupindex else m.group(1))
        if is_kind(st.st_mode) and st.st_uid == me and not owner_alive(pid, st.st_mtime):
            out.append(path)
    return out
