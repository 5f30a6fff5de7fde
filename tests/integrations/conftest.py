"""Trainer runs call ``gc.collect()`` at each ``train()`` (Accelerate's ``free_memory``): with
transformers imported that scan takes ~1 s on a busy 2-core box, half of a tiny run. The
objects that exist when a test module starts are frozen out of the scan (``gc.freeze``) and
thawed at its end; everything made later is collected as usual."""

import gc

import pytest


@pytest.fixture(scope="module", autouse=True)
def frozen_gc():
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
