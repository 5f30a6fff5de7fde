"""Trace policy (Belady / MIN on the recorded step) and lookahead prefetch, through a real store.

Counts are bytes moved by the store (``stats()["moved_bytes"]``); keys of one size ``U`` make
them miss counts. Optimal counts come from the textbook example and from an exhaustive search
over cache contents (independent of Belady's rule).
"""

import math
import random

import pytest
import torch

from tiermem import StoreConfig, TierStore
from tiermem.store.policies import make_policy
from tiermem.store.prefetch import Prefetcher
from tiermem.store.trace import AccessTrace, StepOrdinalKeys, TracePolicy

U = 4096  # bytes per key
TEXTBOOK = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]  # 3 frames: OPT 9, LRU 12


def value(k, step=0):
    return torch.full((U // 4,), float(hash((k, step)) % 100003), dtype=torch.float32)


def make(tmp_path, policy, gpu_units, cpu_units=64, nvme_units=0, lookahead=0):
    return TierStore(StoreConfig(
        gpu_bytes=gpu_units * U, cpu_bytes=cpu_units * U, nvme_bytes=nvme_units * U,
        nvme_dir=str(tmp_path) if nvme_units else None, pool_slab_bytes=cpu_units * U,
        io_backend="posix", io_threads=2, io_chunk_bytes=64 << 10, device="cpu",
        policy=policy, prefetch_lookahead=lookahead))


def check_budgets(store):
    for tier in ("gpu", "cpu", "nvme"):
        assert store.used_bytes(tier) <= store.config.budget(tier), tier


def moved(store, direction=None):
    m = store.stats()["moved_bytes"]
    return (m.get(direction, 0) if direction else sum(m.values())) // U


def run_steps(store, keys, seq, steps, tier="cpu", check=False):
    """Put ``keys`` into ``tier``, mark the setup as a step, run ``seq`` ``steps`` times.

    ``seq`` items are keys (get into gpu) or ``(key, tier)`` pairs. Returns the cpu->gpu (or
    all-tier) move counts per step and checks every value read.
    """
    for k in keys:
        store.put(k, value(k), tier=tier)
    store.mark_step()
    per_step = []
    for _ in range(steps):
        before = moved(store)
        for item in seq:
            k, t = item if isinstance(item, tuple) else (item, "gpu")
            assert torch.equal(store.get(k, t), value(k)), k
            if check:
                check_budgets(store)
        store.mark_step()
        per_step.append(moved(store) - before)
    return per_step


def optimal_misses(seq, capacity, cached=()):
    """Fewest demand misses for ``seq`` with ``capacity`` unit slots (exhaustive search)."""
    states = {frozenset(cached): 0}
    for k in seq:
        nxt = {}
        for s, cost in states.items():
            if k in s:
                options = [(s, cost)]
            elif len(s) < capacity:
                options = [(s | {k}, cost + 1)]
            else:
                options = [((s - {v}) | {k}, cost + 1) for v in s]
            for s2, c2 in options:
                if c2 < nxt.get(s2, math.inf):
                    nxt[s2] = c2
        states = nxt
    return min(states.values())


# ---------------------------------------------------------------------------------- trace


def test_access_trace_next_use_is_cyclic_and_from_keys_checks():
    tr = AccessTrace.from_keys("abcab", nbytes=8)
    assert len(tr) == 5 and tr.keys() == list("abcab") and tr.uses("a") == [0, 3]
    assert tr.next_use("a", 0) == 0 and tr.next_use("a", 1) == 2
    assert tr.next_use("c", 3) == 2 + 5 - 3  # wraps into the next step
    assert tr.next_use("c", 3, cyclic=False) == math.inf
    assert tr.next_use("zz", 0) == math.inf
    assert tr.bytes_by_phase()["forward"] == 40
    with pytest.raises(ValueError, match="tier"):
        AccessTrace.from_keys("ab", tier="disk")
    with pytest.raises(ValueError, match="sizes"):
        AccessTrace.from_keys("ab", nbytes=[1])
    with pytest.raises(TypeError):
        TracePolicy(trace=["a"])
    with pytest.raises(ValueError, match="retrace_after"):
        TracePolicy(retrace_after=0)
    assert isinstance(make_policy("trace"), TracePolicy)


def test_textbook_sequence_min_9_vs_lru_12(tmp_path):
    """Silberschatz's reference string, 3 frames, cold cache: OPT 9 faults, LRU 12."""
    assert optimal_misses(TEXTBOOK, 3) == 9
    keys = sorted(set(TEXTBOOK))
    with make(tmp_path, "lru", 3) as lru:
        assert run_steps(lru, keys, TEXTBOOK, 1)[0] == 12 + 9  # misses + write-backs
        assert moved(lru, "cpu->gpu") == 12
    with make(tmp_path, TracePolicy(AccessTrace.from_keys(TEXTBOOK)), 3) as st:
        run_steps(st, keys, TEXTBOOK, 1)
        assert moved(st, "cpu->gpu") == 9 and moved(st, "gpu->cpu") == 9 - 3
        assert st._policy.counts["followed_steps"] == 1


def test_recorded_trace_is_optimal_after_the_recorded_step(tmp_path):
    """The setup puts are recorded first and replaced by step 1 (which diverged from them, LRU);
    steps 2.. follow it and miss exactly the optimum given the cache step 1 left."""
    keys = sorted(set(TEXTBOOK))
    with make(tmp_path, "lru", 3) as lru, make(tmp_path, "trace", 3) as st:
        lru_steps = run_steps(lru, keys, TEXTBOOK, 5)
        trace_steps = run_steps(st, keys, TEXTBOOK, 5)
        pol = st._policy
        assert pol.counts["followed_steps"] == 4 and pol.counts["retraces"] == 1
        assert trace_steps[0] == lru_steps[0]  # step 1: LRU while recording
        # later steps start from the cache the previous one left: optimum over the rest
        rest = TEXTBOOK * 4
        cached = _lru_cache_after(TEXTBOOK, 3)
        assert moved(st, "cpu->gpu") - 12 == optimal_misses(rest, 3, cached)
        assert sum(trace_steps) < sum(lru_steps)


def _lru_cache_after(seq, capacity):
    cache = []
    for k in seq:
        if k in cache:
            cache.remove(k)
        elif len(cache) == capacity:
            cache.pop(0)
        cache.append(k)
    return cache


@pytest.mark.parametrize("seed", range(6))
def test_small_random_traces_hit_the_optimum(tmp_path, seed):
    rng = random.Random(seed)
    n, cap = rng.randint(4, 7), rng.randint(2, 4)
    seq = [rng.randrange(n) for _ in range(rng.randint(10, 18))]
    with make(tmp_path, TracePolicy(AccessTrace.from_keys(seq)), cap) as st:
        run_steps(st, range(n), seq, 3)
        assert moved(st, "cpu->gpu") == optimal_misses(seq * 3, cap)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("lookahead", [0, 6])
def test_random_traces_never_move_more_than_lru(tmp_path, seed, lookahead):
    """Three tiers, some accesses only need the cpu tier, repeated steps, budgets checked after
    every access."""
    rng = random.Random(100 + seed)
    n = 14
    seq = [(rng.randrange(n), "gpu" if rng.random() < 0.75 else "cpu") for _ in range(40)]
    sizes = dict(gpu_units=4, cpu_units=6, nvme_units=n + 8)
    with make(tmp_path, "lru", **sizes) as lru, \
            make(tmp_path, "trace", lookahead=lookahead, **sizes) as st:
        lru_steps = run_steps(lru, range(n), seq, 4, tier="nvme")
        trace_steps = run_steps(st, range(n), seq, 4, tier="nvme", check=True)
        assert trace_steps[0] == lru_steps[0]
        assert sum(trace_steps) <= sum(lru_steps), (trace_steps, lru_steps)
        assert st._policy.counts["followed_steps"] >= 2


def test_random_variable_sizes_never_move_more_than_lru(tmp_path):
    rng = random.Random(7)
    n = 10
    sizes = {k: rng.choice([1, 2, 3]) for k in range(n)}
    seq = [rng.randrange(n) for _ in range(30)]
    results = {}
    for name in ("lru", "trace"):
        with make(tmp_path, name, gpu_units=6) as st:
            for k in range(n):
                st.put(k, torch.full((sizes[k] * U // 4,), float(k)), tier="cpu")
            st.mark_step()
            for _ in range(4):
                for k in seq:
                    assert st.get(k)[0].item() == k
                st.mark_step()
            results[name] = moved(st)
    assert results["trace"] <= results["lru"], results


# ---------------------------------------------------------------------------------- divergence


def test_diverging_step_falls_back_to_lru_cleanly(tmp_path):
    keys = sorted(set(TEXTBOOK))
    with make(tmp_path, "trace", 3) as st:
        run_steps(st, keys, TEXTBOOK, 3)
        pol = st._policy
        assert pol.following
        odd = [7, 0, 1, 2, 2, 4, 3, 1, 0, 7, 2, 4, 1, 0]
        before = pol.counts["lru_victims"]
        diverged = pol.counts["diverged_steps"]
        for k in odd:
            assert torch.equal(st.get(k), value(k))  # no exception, data intact
            check_budgets(st)
        assert not pol.following and pol.counts["lru_victims"] > before
        assert pol.next_use(0) == math.inf and pol.upcoming(5) == []
        st.mark_step()
        assert pol.following and pol.counts["diverged_steps"] == diverged + 1
        assert pol.position == 0
        # the next normal step follows the recording again (one odd step does not replace it)
        for k in TEXTBOOK:
            assert torch.equal(st.get(k), value(k))
        st.mark_step()
        assert pol.counts["retraces"] == 1 and pol.counts["followed_steps"] >= 2
        # a step that is a prefix of the recording is not a followed step
        for k in TEXTBOOK[:5]:
            st.get(k)
        st.mark_step()
        assert pol.counts["diverged_steps"] == diverged + 2
        for k in keys:
            assert torch.equal(st.get(k, "cpu"), value(k))


def test_changed_workload_is_re_recorded(tmp_path):
    keys = sorted(set(TEXTBOOK))
    new = list(reversed(TEXTBOOK)) + [3, 3]
    with make(tmp_path, TracePolicy(retrace_after=2), 3) as st:
        run_steps(st, keys, TEXTBOOK, 3)
        for _ in range(4):
            for k in new:
                assert torch.equal(st.get(k), value(k))
            st.mark_step()
        pol = st._policy
        assert pol.trace.keys() == new and pol.counts["retraces"] == 2
        assert pol.counts["diverged_steps"] == 3  # step 1 of new + 2 before the retrace


def test_deleted_and_regenerated_keys_with_step_ordinal_keys(tmp_path):
    """Activation-like keys: a new key per tensor per step, deleted after use."""
    key_fn = StepOrdinalKeys(lambda k: "act" if k[0] == "act" else None)
    with make(tmp_path, TracePolicy(key_fn=key_fn), 3, lookahead=4) as st:
        counter = 0
        for step in range(4):
            made = []
            for i in range(5):
                k = ("act", counter)
                counter += 1
                st.put(k, value(i, step), tier="cpu")
                made.append((k, i))
            for k, i in reversed(made):
                assert torch.equal(st.get(k), value(i, step))
                st.delete(k)
                check_budgets(st)
            st.mark_step()
        pol = st._policy
        assert pol.counts["followed_steps"] >= 2 and len(st) == 0
        assert st._prefetcher.counts["issued"] > 0  # later keys came up before their get


# ---------------------------------------------------------------------------------- prefetch


def test_try_prefetch_uses_free_room_only_without_evictable(tmp_path):
    with make(tmp_path, "lru", 2, nvme_units=8) as st:
        for k in range(4):
            st.put(k, value(k), tier="nvme")
        assert st.try_prefetch("missing") is None
        f = st.try_prefetch(0, "gpu")  # nvme -> gpu
        f.wait()
        assert st.tier_of(0) == "gpu"
        st.try_prefetch(1, "cpu").wait()  # nvme -> cpu
        st.try_prefetch(1, "gpu").wait()  # cpu -> gpu
        assert st.try_prefetch(2, "gpu") is None  # gpu full: nothing evicted
        assert st.tier_of(0) == st.tier_of(1) == "gpu" and st.tier_of(2) == "nvme"
        assert st.try_prefetch(0, "cpu").done()  # already higher
        f = st.try_prefetch(2, "gpu", evictable=lambda k: k == 1)
        f.wait()
        assert st.tier_of(1) == "cpu" and st.tier_of(2) == "gpu"
        with st.hold(3, "cpu"):
            assert st.try_prefetch(3, "gpu") is None  # held: not moved
        with pytest.raises(ValueError, match="nvme"):
            st.try_prefetch(0, "nvme")
        for k in range(4):
            assert torch.equal(st.get(k, "cpu"), value(k))
        check_budgets(st)


def test_prefetch_lookahead_config_checks(tmp_path):
    with pytest.raises(ValueError, match="policy='trace'"):
        StoreConfig(prefetch_lookahead=4)
    with pytest.raises(ValueError, match="prefetch_lookahead"):
        StoreConfig(policy="trace", prefetch_lookahead=-1)
    with pytest.raises(TypeError, match="trace policy"):
        TierStore(StoreConfig(policy=make_policy("lru"), prefetch_lookahead=4, gpu_bytes=U,
                              cpu_bytes=4 * U, pool_slab_bytes=4 * U))
    with pytest.raises(ValueError, match="lookahead"):
        Prefetcher(None, TracePolicy(), 0)


class BudgetWatch(TracePolicy):
    """Checks every tier's budget whenever the store consults or tells the policy anything,
    i.e. inside operations and while prefetches are in flight."""

    checks = 0

    def _check(self):
        if self._store is not None and not self._store.closed:
            check_budgets(self._store)
            BudgetWatch.checks += 1

    def on_access(self, key, tier):
        self._check()
        super().on_access(key, tier)

    def on_move(self, key, old_tier, new_tier):
        self._check()
        super().on_move(key, old_tier, new_tier)

    def victims(self, tier):
        self._check()
        return super().victims(tier)


def test_prefetch_never_breaks_a_budget_and_moves_ahead(tmp_path):
    """nvme -> cpu -> gpu with spill reads in flight; budgets checked after every operation,
    inside them, and by a recorder sample at every change."""
    from tiermem.telemetry import Recorder

    rng = random.Random(3)
    n = 16
    seq = [(rng.randrange(n), rng.choice(["gpu", "gpu", "cpu"])) for _ in range(48)]
    rec = Recorder()
    with make(tmp_path, BudgetWatch(), 3, cpu_units=5, nvme_units=n + 8, lookahead=8) as st:
        st.recorder = rec
        run_steps(st, range(n), seq, 4, tier="nvme", check=True)
        pf = st._prefetcher
        assert pf.counts["issued"] > 0 and st._policy.counts["followed_steps"] >= 2
        for _, used in rec.samples:
            for tier, n_used in used.items():
                assert n_used <= rec.budgets[tier], (tier, n_used)
        assert {"nvme->cpu", "cpu->gpu"} <= set(rec.bytes_by_direction())
    assert BudgetWatch.checks > 100


def test_prefetch_streams_keys_ahead_of_a_layer_sweep(tmp_path):
    """Layer-by-layer streaming (get a key, use it, evict it; like optimizer state chunks):
    with lookahead the get finds the key already up, and no byte more moves than with LRU."""
    seq = list(range(12))

    def sweep(store, steps):
        for k in seq:
            store.put(k, value(k), tier="nvme")
        store.mark_step()
        hits = 0
        for _ in range(steps):
            for k in seq:
                hits += store.tier_of(k) == "gpu"
                assert torch.equal(store.get(k), value(k))
                store.evict(k, "nvme").wait()
                check_budgets(store)
            store.mark_step()
        return hits, moved(store)

    with make(tmp_path, "trace", 3, cpu_units=4, nvme_units=16, lookahead=4) as st, \
            make(tmp_path, "lru", 3, cpu_units=4, nvme_units=16) as lru:
        hits, n_moved = sweep(st, 4)
        lru_hits, lru_moved = sweep(lru, 4)
        assert lru_hits == 0 and hits >= 2 * (len(seq) - 1)  # steps 3 and 4 prefetched
        assert n_moved == lru_moved
        assert {"nvme->gpu"} <= set(st.stats()["moved_bytes"])


# ---------------------------------------------------------------------------------- deaths


def test_access_trace_next_death_is_cyclic():
    tr = AccessTrace(AccessTrace.from_keys("abcab").accesses, deaths=[("c", 4), ("a", 2)])
    assert tr.next_death("a", 0) == 2 and tr.next_death("c", 3) == 1
    assert tr.next_death("c", 5) == 4 + 5 - 5  # wraps into the next step
    assert tr.next_death("c", 5, cyclic=False) == math.inf
    assert tr.next_death("b", 0) == math.inf  # never removed


def test_dead_keys_are_never_used_again_and_prefetch_waits_for_their_room(tmp_path):
    """Each step: put D, get A, two cpu reads, delete D, get B, three cpu reads. Once the trace
    is followed, D (removed before its next use) has next use infinity; right after get A (gpu
    full: D and A), a lookahead prefetch of B must not evict D: D leaves before B's access, so
    B gets D's room then and nothing is written back (see Note [deaths])."""
    policy = TracePolicy()
    with make(tmp_path, policy, 2) as st:
        for k in ("A", "B", "X0", "X1", "Y0", "Y1", "Y2"):
            st.put(k, value(k), tier="cpu")
        st.mark_step()
        for step in range(3):
            st.put("D", value("D", step), tier="gpu")
            assert torch.equal(st.get("A"), value("A"))
            if step == 2:  # recorded in step 0 (step 1 re-records the setup), followed now
                assert policy.following and policy.position == 2
                assert policy.next_use("D") == math.inf and policy.next_use("A") == 8 - 1
                assert policy.frees_room("gpu", 2) and not policy.frees_room("gpu", 1)
                assert not policy.frees_room("cpu", 10)
                before = st.stats()["moved_bytes"].get("gpu->cpu", 0)
                pf = Prefetcher(st, policy, lookahead=8)
                assert pf.after_access("A") == 0 and pf.counts["no_room"] == 1
                assert st.tier_of("D") == "gpu"
                assert st.stats()["moved_bytes"].get("gpu->cpu", 0) == before
            for k in ("X0", "X1"):
                st.get(k, "cpu")
            st.delete("D")
            assert torch.equal(st.get("B"), value("B"))
            for k in ("Y0", "Y1", "Y2"):
                st.get(k, "cpu")
            st.evict("A", "cpu")
            st.evict("B", "cpu")
            st.mark_step()
        assert policy.counts["followed_steps"] >= 1
