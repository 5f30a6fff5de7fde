"""Reliability tests: start the crash-safety fork server early, so it warms up in parallel."""

from __future__ import annotations

import _server


def pytest_collection_finish(session):
    # Under pytest-xdist every worker collects every test but only one runs test_crash_safety's
    # server tests (Note [xdist groups]): there the first of them starts it (get_server).
    if hasattr(session.config, "workerinput"):
        return
    if any(item.module.__name__.endswith("test_crash_safety") for item in session.items
           if getattr(item, "module", None) is not None):
        _server.start_server()


def pytest_sessionfinish(session, exitstatus):
    _server.stop_server()
