"""The three-tier tensor store and its parts (pool, transfers, spill files, I/O backends)."""

from tiermem.store.policy import LRUPolicy, Policy
from tiermem.store.store import StoreClosedError, TierFullError, TierStore
from tiermem.store.transfer import TransferFuture

__all__ = ["TierStore", "TierFullError", "StoreClosedError", "TransferFuture", "Policy", "LRUPolicy"]
