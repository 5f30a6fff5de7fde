"""Schedules that follow the layer execution order: which activation layers to offload, from
measured compute and transfer times (:mod:`tiermem.schedule.layers`), and one step's
micro-batches with the first blocks breadth-first (:mod:`tiermem.schedule.micro_batches`).
Next-use eviction and lookahead prefetch are part of the store (:mod:`tiermem.store.trace`,
:mod:`tiermem.store.prefetch`); the policy tuner is :mod:`tiermem.apps.tune`."""
