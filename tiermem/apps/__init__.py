"""The applications built on the library: ``tiermem plan`` (:mod:`tiermem.apps.plan`),
``tiermem tune`` (:mod:`tiermem.apps.tune`), ``tiermem bench`` (:mod:`tiermem.apps.bench`),
``tiermem demo`` (:mod:`tiermem.apps.demo`, with :mod:`tiermem.apps.run_cost`) and the
``tiermem`` command (:mod:`tiermem.apps.cli`). They import the library; no library module imports
them (tests/store/test_layering.py checks it). What the library itself needs of the planner's
world lives in the library: the machine's rates (:mod:`tiermem.rates`) and the model shapes
(:mod:`tiermem.shapes`).
"""
