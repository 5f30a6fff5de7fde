"""The lookahead prefetcher's decisions, access by access (issue 27 test-suite slips): which key
it prefetches after which access for a lookahead of N, how many gets hit and how many moves a
step costs; and that a prefetch never evicts a key needed as soon as the one it brings in."""

import math

import pytest
import torch

from tiermem import StoreConfig, TierStore
from tiermem.store.prefetch import Prefetcher
from tiermem.store.trace import TracePolicy

U = 4096  # one key: one unit of bytes
KEYS = list(range(10))


def value(k):
    return torch.full((U // 4,), float(k) + 0.5, dtype=torch.float32)


def make(tmp_path, policy, gpu_units, lookahead=0):
    return TierStore(StoreConfig(
        gpu_bytes=gpu_units * U, cpu_bytes=64 * U, nvme_bytes=64 * U, nvme_dir=str(tmp_path),
        pool_slab_bytes=64 * U, io_backend="posix", io_threads=2, io_chunk_bytes=U,
        device="cpu", policy=policy, prefetch_lookahead=lookahead))


def logging_prefetches(store, log, current):
    """Wrap ``store.try_prefetch``: append ``(key accessed last, key moved up)`` per started
    prefetch (``current[0]`` is the key of the access in progress)."""
    real = store.try_prefetch

    def try_prefetch(key, tier="gpu", **kw):
        below = store.tier_of(key) != tier
        future = real(key, tier, **kw)
        if future is not None and below:
            log.append((current[0], key))
        return future

    store.try_prefetch = try_prefetch


@pytest.mark.parametrize("lookahead", [1, 3, 5])
def test_a_layer_sweep_prefetches_exactly_lookahead_accesses_ahead(tmp_path, lookahead):
    """Streaming: get each key into the gpu tier, then evict it to nvme. The gpu tier has room
    for lookahead + 1 keys, so once the step is followed, the access of key i (whose prefetch
    sees the next ``lookahead`` accesses i+1 .. i+lookahead, all but the last already up)
    brings up exactly key i + lookahead; the first access (nothing prefetched before the step
    starts) is the only miss, and each key moves up once."""
    policy = TracePolicy()
    log, current = [], [None]
    with make(tmp_path, policy, lookahead + 1, lookahead) as st:
        for k in KEYS:
            st.put(k, value(k), tier="nvme")
        st.mark_step()
        logging_prefetches(st, log, current)
        per_step = []
        for step in range(3):  # 0: recorded, 1: re-recorded (the setup was step 0), 2: followed
            log.clear()
            hits = 0
            before = st.stats()["moved_bytes"].get("nvme->gpu", 0)
            for k in KEYS:
                current[0] = k
                hits += st.tier_of(k) == "gpu"
                assert torch.equal(st.get(k), value(k))
                st.evict(k, "nvme").wait()
            st.mark_step()
            reloads = (st.stats()["moved_bytes"].get("nvme->gpu", 0) - before) // U
            per_step.append((hits, reloads, list(log)))
        hits, reloads, decisions = per_step[-1]
        assert policy.counts["followed_steps"] >= 1
        want = [(0, k) for k in range(1, lookahead + 1)]  # the first access fills the window
        want += [(i, i + lookahead) for i in range(1, len(KEYS) - lookahead)]  # then one each
        assert decisions == want
        assert hits == len(KEYS) - 1  # only key 0 was not up when its get came
        assert reloads == len(KEYS)  # each key read up once: prefetched or (key 0) demanded


def test_a_prefetch_never_evicts_a_key_needed_as_soon_as_the_one_it_brings_in(tmp_path):
    """Two versions of one tensor share an id (``key_fn``), so they are needed at the same
    distance. Step: get wb (cpu), get K (gpu: now wa and K fill it), get wb (gpu), get Y (cpu).
    After the access of K the lookahead's next access is wb's: bringing wb up would have to
    evict wa, needed at the same distance (K, just accessed, is never a victim). The policy
    refuses: the prefetch finds no room, wa stays, and wb's get is a demand load that evicts
    K (furthest next use), as MIN does."""
    wa, wb = ("w", "a"), ("w", "b")
    policy = TracePolicy(key_fn=lambda k: k[0] if isinstance(k, tuple) else k)
    log, current, probes = [], [None], []
    with make(tmp_path, policy, 2) as st:
        st.put(wa, value(1), tier="gpu")
        for k, v in ((wb, value(2)), ("K", value(3)), ("Y", value(4))):
            st.put(k, v, tier="cpu")
        st.mark_step()
        pf = Prefetcher(st, policy, lookahead=1)
        logging_prefetches(st, log, current)
        real = st.try_prefetch

        def probing(key, tier="gpu", evictable=None):
            if key == wb and evictable is not None:  # the decision on each resident key
                probes.append({v: evictable(v) for v in (wa, "K")})
            return real(key, tier, evictable=evictable)

        st.try_prefetch = probing
        for step in range(3):  # 0: recorded, 1: re-recorded (the setup was step 0), 2: followed
            log.clear()
            probes.clear()
            no_room = pf.counts["no_room"]
            before = dict(st.stats()["moved_bytes"])
            for k, tier in ((wb, "cpu"), ("K", "gpu"), (wb, "gpu"), ("Y", "cpu")):
                current[0] = k
                assert torch.equal(st.get(k, tier), {wa: value(1), wb: value(2), "K": value(3),
                                                      "Y": value(4)}[k])
                if step == 2 and k == "K":
                    assert policy.next_use(wa) == policy.next_use(wb) == 0  # same distance
                    assert st.tier_of(wa) == st.tier_of("K") == "gpu"
                pf.after_access(k)
            for k in (wb, "K"):  # back to the start: wa alone in the gpu tier
                if st.tier_of(k) == "gpu":
                    st.evict(k, "cpu").wait()
            TierStore.try_prefetch(st, wa, "gpu").wait()  # a hint, not an access: not logged
            st.mark_step()
        after = st.stats()["moved_bytes"]
        assert policy.counts["followed_steps"] >= 1
        assert log == [("Y", "K")] or log == [(wb, "K")]  # only K, into free room
        assert probes == [{wa: False, "K": False}]  # wa refused (same distance), K: just used
        assert pf.counts["no_room"] - no_room == 1  # so the walk stopped there
        assert st.tier_of(wa) == "gpu"  # never moved
        moves = {d: (after.get(d, 0) - before.get(d, 0)) // U for d in after}
        assert moves.get("gpu->cpu", 0) == 2 and moves.get("cpu->gpu", 0) == 2  # K and wb
        assert math.isfinite(policy.next_use(wa))
