"""Who sums a streamed weight's host copy after HybridAdam's write-back (Note [streamed
write-back checksums] in tiermem/optim/param_sums.py): with the native kernel every piece the
chunk worker steps in place (Note [in-place host chunks]) is summed by the kernel as it writes
it (tm_adam_step_sum), so the worker calls no Python sum on its hot path; before, it re-read
every piece it had just written with ``piece_checksum`` (0.11-0.15 s of the H200 reference
GPT's step). The sums must still be right: the watch takes them as the host copies' (no read)
and the ``.data`` writes after each step are each caught once, as the unstreamed run's."""

from __future__ import annotations

import pytest
from _stream_train import make_model
from test_stream_inplace import STEPS, _hybrid

from tiermem.optim import cpu_adam, param_watch
from tiermem.optim.cpu_adam import native_available

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def stores(make_stream_store):
    return lambda: make_stream_store(nvme_bytes=64 << 20)


def _counted(monkeypatch):
    """Count the Python sums of written pieces: the watch's and the fallback kernel's."""
    calls = {"piece_checksum": 0, "placed_checksum": 0}

    def wrap(module, name):
        real = getattr(module, name)

        def counted(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)

    wrap(param_watch, "piece_checksum")
    wrap(cpu_adam, "placed_checksum")
    return calls


def _run(stores, monkeypatch, refreshed):
    from tiermem.optim.param_watch import ParamWatch
    refresh = ParamWatch._refresh
    monkeypatch.setattr(ParamWatch, "_refresh", lambda self, gi, i, rebind: (
        refreshed.append(i), refresh(self, gi, i, rebind=rebind)))
    _, stats = _hybrid(stores, True)
    return stats


@pytest.mark.skipif(not native_available(), reason="the fused sum is the native kernel's")
def test_the_worker_sums_no_in_place_piece_in_python(stores, monkeypatch):
    n_streamed = sum(1 for n, _ in make_model().named_parameters() if n.startswith("blocks."))
    calls = _counted(monkeypatch)
    refreshed = []
    stats = _run(stores, monkeypatch, refreshed)
    assert calls == {"piece_checksum": 0, "placed_checksum": 0}
    assert stats["known_bases"] == STEPS * n_streamed  # every host copy's sum from its pieces
    assert len(refreshed) == 3 * (STEPS - 1)  # _scale_after_step's 3 writes, each seen once


def test_without_the_native_kernel_the_worker_sums_in_python(stores, monkeypatch):
    """The fallback (torch's kernel; only one-piece chunks in place): the same sums and
    catches, summed in Python on the worker (the counter sees them, so the test above can
    fail)."""
    n_streamed = sum(1 for n, _ in make_model().named_parameters() if n.startswith("blocks."))
    monkeypatch.setattr(cpu_adam, "_native_lib", lambda: None)
    monkeypatch.setattr(cpu_adam, "_fallback_warned", True)
    calls = _counted(monkeypatch)
    refreshed = []
    stats = _run(stores, monkeypatch, refreshed)
    assert calls["piece_checksum"] > 0
    assert stats["known_bases"] == STEPS * n_streamed
    assert len(refreshed) == 3 * (STEPS - 1)
