"""Issue 17.8 (HybridAdam part): a large offloaded-state set-up shows a tqdm bar on a terminal;
a small one, or one whose stderr is not a terminal, prints no bar."""

from __future__ import annotations

import io
import logging

import pytest
import torch

import tiermem._log as log_mod
import tiermem.optim.layout as layout
from tiermem.optim import HybridAdam


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _build(state_tier="cpu", **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    return HybridAdam(model.parameters(), placement="given", chunk_numel=1024,
                      state_tier=state_tier, **kw)


@pytest.mark.parametrize("big, terminal, shown", [(True, True, True), (False, True, False),
                                                  (True, False, False)])
def test_state_setup_progress_bar(monkeypatch, tmp_path, big, terminal, shown):
    err = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    if big:
        monkeypatch.setattr(layout, "_PROGRESS_MIN_BYTES", 0)  # as if the state were >= 1 GiB
    bars = []
    monkeypatch.setattr(layout, "progress", lambda *a, **k: bars.append(log_mod.progress(*a, **k))
                        or bars[-1])
    opt = _build()
    opt.close()
    out = err.getvalue()
    assert ("HybridAdam: offloaded state" in out) == shown, out
    assert len(bars) == big
    if shown:  # 64*64+64 + 64*8+8 params in chunks of 1024: 5 chunks, all counted
        assert (bars[0].n, bars[0].total, bars[0].unit) == (5, 5, "chunk")


def test_state_setup_is_logged(caplog, tmp_path):
    with caplog.at_level(logging.INFO, logger="tiermem"):
        _build("nvme", nvme_dir=str(tmp_path)).close()
    assert any("HybridAdam: setting up 5 chunks" in r.getMessage() and "nvme tier" in
               r.getMessage() for r in caplog.records)
