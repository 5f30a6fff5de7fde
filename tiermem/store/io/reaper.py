"""Teardown a finalizer must not run where it is called (Note [finalizer teardown]).

Note [finalizer teardown]: a ``weakref.finalize`` callback runs wherever its object dies: in a
garbage collection that any allocation may start, on any thread, even while that thread holds
one of :mod:`threading`'s own locks. Seen once in a clean-clone run of the suite (Python 3.11,
tests/reliability/test_lifetime.py, hung): a new I/O thread, registering itself under
``threading._shutdown_locks_lock``, allocated; the collection this started finalized a dropped
store, whose teardown joined its own, non-daemon I/O threads; a join takes that lock, so the
thread waited on itself, and the thread starting it waited forever too. Starting a helper
thread there is no way out (``Thread.start`` takes ``threading._active_limbo_lock``). So
teardown that joins threads goes through :func:`run_or_defer`: it runs at once, except inside
a collection (:func:`collecting`, kept by a ``gc.callbacks`` hook) or on a thread it would join
(an I/O callback that dropped the last reference), where it is queued
(``queue.SimpleQueue.put`` is safe inside a collection) to the reaper, a daemon thread that
ordinary code starts (:func:`start`: the I/O backends' constructors). A job queued just before
the interpreter exits may not run; the directory it would remove is then a dead process's, which
:func:`tiermem.store.nvme.cleanup_stale` removes.
"""

from __future__ import annotations

import gc
import os
import queue
import threading
from typing import Callable

from tiermem._log import logger

_jobs: queue.SimpleQueue = queue.SimpleQueue()
_state = threading.local()
_start_lock = threading.Lock()
_thread: threading.Thread | None = None


def _on_gc(phase: str, info: dict) -> None:
    _state.collecting = phase == "start"


gc.callbacks.append(_on_gc)


def _forget_in_child() -> None:
    """After a fork: the parent's reaper thread, its queue (teardown of the parent's backends)
    and a start lock another thread may have held do not belong to the child."""
    global _jobs, _start_lock, _thread
    _jobs, _start_lock, _thread = queue.SimpleQueue(), threading.Lock(), None


os.register_at_fork(after_in_child=_forget_in_child)


def collecting() -> bool:
    """Whether the calling thread is inside a garbage collection (its finalizers run there)."""
    return getattr(_state, "collecting", False)


def note_thread(idents: set) -> None:
    """Thread-pool initializer: remember the worker's ident (``on_joined_thread`` of
    :func:`run_or_defer`)."""
    idents.add(threading.get_ident())


def start() -> None:
    """Start the reaper thread of this process unless it runs (after a fork it does not).
    Call from ordinary code, never from a finalizer.

    Raises:
        RuntimeError: the thread could not be started.
    """
    global _thread
    with _start_lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="tiermem-reaper", daemon=True)
            _thread.start()


def run_or_defer(job: Callable[[], None], *, on_joined_thread: bool = False) -> None:
    """Run ``job()`` now, or queue it to the reaper when called inside a garbage collection or
    on a thread ``job`` joins (``on_joined_thread``): Note [finalizer teardown].

    Raises:
        Whatever ``job`` raises when it runs now; a queued job's errors are logged.
    """
    if on_joined_thread or collecting():
        _jobs.put(job)
        return
    job()


def wait_idle(timeout_s: float | None = None) -> bool:
    """Wait until every job queued so far has run (tests, and code that counts what teardown
    frees); not from a finalizer.

    Returns:
        True when they have, False when ``timeout_s`` seconds passed first.
    """
    if _thread is None or not _thread.is_alive():
        return _jobs.empty()
    done = threading.Event()
    _jobs.put(done.set)  # runs after every job queued before it
    return done.wait(timeout_s)


def _run() -> None:
    while True:
        job = _jobs.get()
        try:
            job()
        except Exception as exc:  # noqa: BLE001  (teardown: log and go on to the next)
            logger.warning("tiermem: deferred teardown failed: %s", exc)
        del job  # the job holds the dead object's backend: let it go before waiting again
