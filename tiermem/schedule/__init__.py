"""Schedules keyed to the execution order: the access trace of one step, next-use (Belady)
eviction and lookahead prefetch (the policy tuner is :mod:`tiermem.tune`)."""

from tiermem.schedule.prefetch import Prefetcher
from tiermem.schedule.trace import Access, AccessTrace, StepOrdinalKeys, TracePolicy

__all__ = ["Access", "AccessTrace", "StepOrdinalKeys", "TracePolicy", "Prefetcher"]
