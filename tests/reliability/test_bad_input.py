"""Issue 16.8: odd budgets get the same clear message as other bad budgets; evict to a missing
nvme tier is a ValueError; a closed store reports nothing in use and refuses lookups."""

from __future__ import annotations

import re

import pytest
import torch

from _faults import rand, small_store
from tiermem import StoreConfig, TierStore
from tiermem.store.store import StoreClosedError


@pytest.mark.parametrize("field", ["gpu_bytes", "cpu_bytes", "nvme_bytes", "pool_slab_bytes"])
@pytest.mark.parametrize("value", ["1e400", float("inf"), float("-inf"), float("nan"), "inf",
                                   "nan"])
def test_non_finite_budgets_name_the_field(field, value):
    kw = {field: value}
    if field == "nvme_bytes":
        kw["nvme_dir"] = "/tmp"
    with pytest.raises(ValueError, match=rf"StoreConfig\.{field}={re.escape(repr(value))} is "
                                         rf"(not a finite byte size|not a byte size|negative)"):
        StoreConfig(**kw)


def test_evict_to_a_missing_nvme_tier_is_a_value_error(tmp_path):
    store = TierStore(StoreConfig(gpu_bytes=1 << 20, cpu_bytes=1 << 20, device="cpu"))
    store.put("k", rand(100), tier="cpu")
    with pytest.raises(ValueError, match=r"evict\('k', 'nvme'\): this store has no nvme tier "
                                         r"\(StoreConfig.nvme_bytes=0\)"):
        store.evict("k", "nvme")
    assert store.tier_of("k") == "cpu" and torch.equal(store.get("k", "cpu"), rand(100))
    store.close()


def test_a_closed_store_uses_nothing_and_refuses_lookups(tmp_path):
    store = small_store(tmp_path)
    store.put("k", rand(2000), tier="nvme")
    store.put("j", rand(100), tier="cpu")
    store.synchronize()
    assert store.used_bytes("nvme") > 0
    store.close()
    assert [store.used_bytes(t) for t in ("gpu", "cpu", "nvme")] == [0, 0, 0]
    for call in (lambda: store.tier_of("k"), lambda: store.nbytes_of("k"),
                 lambda: store.release("k"), lambda: store.get("k"),
                 lambda: store.put("x", rand(10))):
        with pytest.raises(StoreClosedError, match="this TierStore is closed"):
            call()
    store.synchronize()  # nothing in flight: a no-op, as close() is
    store.close()
