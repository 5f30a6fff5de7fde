"""Which activation layers to offload, from measured compute and transfer times
(:mod:`tiermem.schedule.layers`; next-use eviction and lookahead prefetch are part of the store:
:mod:`tiermem.store.trace`, :mod:`tiermem.store.prefetch`; the policy tuner is
:mod:`tiermem.tune`)."""
