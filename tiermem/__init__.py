"""tiermem: train models whose training state does not fit in GPU memory.

A three-tier tensor store (GPU memory, pinned host DRAM, NVMe files) with asynchronous
prefetch, an activation-offload hook layer and a partitioned hybrid CPU/GPU Adam.
"""

from tiermem.config import StoreConfig
from tiermem.store import TierFullError, TierStore

__version__ = "0.1.0"
__all__ = ["TierStore", "StoreConfig", "TierFullError", "__version__"]
