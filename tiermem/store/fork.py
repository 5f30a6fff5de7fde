"""What a forked child does with the stores and spill spaces it inherited (Note [inherited]).

Note [inherited]: ``os.fork`` copies one thread into the child and every lock in the state it
had at that instant, so a lock that another thread of the parent held (the store's, a spill
space's, a queue's) stays held forever in the child, and the threads that would release it or
finish its I/O do not exist there. Objects that own locks or threads register here
(:func:`track`); an ``os.register_at_fork(after_in_child=...)`` hook marks each live one
inherited (its ``_after_fork_in_child()``), before the child runs any code of its own. From
then on every public call of an inherited object refuses at once, before taking any lock
(``StoreClosedError`` for a store), its ``close()`` only forgets the child's copy without
waiting for anything, joining any thread or removing any file of the parent's, and its
finalizers (run when it is dropped or at the child's exit) do the same. Processes started with
``spawn``/``forkserver``, or a child that ``exec``s, inherit nothing.
"""

from __future__ import annotations

import os
import weakref

_live: weakref.WeakSet = weakref.WeakSet()


def track(obj: object) -> None:
    """Mark ``obj`` inherited (``obj._after_fork_in_child()``) in every child forked while it
    lives (Note [inherited]).

    Raises:
        TypeError: ``obj`` cannot be weakly referenced.
    """
    _live.add(obj)


def _after_fork_in_child() -> None:
    # WeakSet iteration takes no lock that another thread could have held (it defers removals
    # with a counter), and the child has one thread: nothing changes it meanwhile
    for obj in list(_live):
        obj._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
