"""The three-tier tensor store and its parts (pool, transfers, spill files, I/O backends) and
its eviction policies (LRU; next-use on the recorded step, with lookahead prefetch)."""

from tiermem.store.policy import LRUPolicy, Policy
from tiermem.store.prefetch import Prefetcher
from tiermem.store.store import StoreClosedError, TierFullError, TierStore
from tiermem.store.trace import (Access, AccessTrace, FunctionKeys, KeyNormaliser,
                                 StepOrdinalKeys, TracePolicy)
from tiermem.store.transfer import TransferFuture

__all__ = ["TierStore", "TierFullError", "StoreClosedError", "TransferFuture", "Policy",
           "LRUPolicy", "TracePolicy", "KeyNormaliser", "FunctionKeys", "StepOrdinalKeys",
           "Access", "AccessTrace", "Prefetcher"]
