"""The policy interface through a real store: ``bind`` and ``mark_step`` are part of
:class:`Policy` (a user's policy needs only ``victims``), and the trace policy's key normaliser
is a :class:`KeyNormaliser` that is told about step boundaries and removed keys."""

import pytest
import torch

from tiermem import StoreConfig, TierStore
from tiermem.store import FunctionKeys, KeyNormaliser, Policy, StepOrdinalKeys, TracePolicy

U = 4096  # bytes per key


def make(policy, gpu_units=2):
    return TierStore(StoreConfig(gpu_bytes=gpu_units * U, cpu_bytes=16 * U,
                                 pool_slab_bytes=16 * U, device="cpu", policy=policy))


def value(k):
    return torch.full((U // 4,), float(k), dtype=torch.float32)


class NewestFirst(Policy):
    """A user's policy: only ``on_access``/``on_move``/``victims``, no bind or mark_step."""

    def __init__(self):
        self.seen = {}

    def on_access(self, key, tier):
        self.seen[key] = tier

    def on_move(self, key, old_tier, new_tier):
        if new_tier is None:
            self.seen.pop(key, None)
        else:
            self.seen[key] = new_tier

    def victims(self, tier):
        return iter([k for k, t in reversed(self.seen.items()) if t == tier])


class Counting(NewestFirst):
    def __init__(self):
        super().__init__()
        self.bound, self.steps = [], 0

    def bind(self, store):
        self.bound.append(store)

    def mark_step(self):
        self.steps += 1


def test_a_policy_with_only_victims_runs_steps():
    with make(NewestFirst()) as st:
        for step in range(2):
            for k in range(4):
                st.put(k, value(k), tier=None if step == 0 else "cpu")
                assert torch.equal(st.get(k), value(k))
            st.mark_step()  # Policy.mark_step: nothing to do for this policy
        assert all(st.used_bytes(t) <= st.config.budget(t) for t in ("gpu", "cpu"))


def test_the_store_binds_its_policy_once_and_marks_each_step():
    pol = Counting()
    with make(pol) as st:
        assert pol.bound == [st]
        for _ in range(3):
            st.put("a", value(1))
            st.mark_step()
        assert pol.steps == 3 and pol.bound == [st]


class Recording(StepOrdinalKeys):
    def __init__(self):
        super().__init__(lambda k: "act" if k[0] == "act" else None)
        self.steps, self.forgotten = 0, []

    def mark_step(self):
        super().mark_step()
        self.steps += 1

    def forget(self, key):
        super().forget(key)
        self.forgotten.append(key)


def test_the_trace_policy_tells_its_key_normaliser_about_steps_and_removals():
    keys = Recording()
    with make(TracePolicy(key_fn=keys)) as st:
        for step in range(2):
            st.put(("act", step), value(step))
            st.delete(("act", step))
            st.mark_step()
        assert keys.steps == 2 and keys.forgotten == [("act", 0), ("act", 1)]
        assert keys(("act", 7)) == ("act", 0)  # counting restarted at the step boundary


def test_trace_policy_key_fn_kinds():
    assert isinstance(TracePolicy().key_fn, KeyNormaliser)
    pol = TracePolicy(key_fn=lambda k: k[0])
    assert isinstance(pol.key_fn, FunctionKeys) and pol.key_fn(("w", 3)) == "w"

    class DuckKeys:  # mark_step/forget without the base class: they would never be called
        def __call__(self, key):
            return key

        def mark_step(self):
            pass

    with pytest.raises(TypeError, match="key_fn=DuckKeys .*subclass"):
        TracePolicy(key_fn=DuckKeys())
    with pytest.raises(TypeError, match="key_fn must be callable"):
        TracePolicy(key_fn=3)
    with pytest.raises(TypeError, match="FunctionKeys: fn must be callable"):
        FunctionKeys("w")
