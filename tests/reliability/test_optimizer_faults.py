"""Issue 16.2: HybridAdam whose NVMe state does not fit the spill disk fails its first step
clearly, and once the disk has room again the next step allocates the state afresh and trains
exactly like an optimizer that never failed."""

from __future__ import annotations

import warnings

import pytest
import torch

import tiermem.store.store as store_mod
from _faults import ENOSPC, FaultBackend
from models import TinyGPT, make_batch
from tiermem import TierFullError
from tiermem.optim import HybridAdam

HP = dict(lr=3e-3, weight_decay=0.1, offload_fraction=0.5, chunk_numel=1024, state_tier="nvme")


def _backward(model, step):
    _, loss = model(*make_batch(step))
    loss.backward()


def _reference(tmp_path, steps):
    torch.manual_seed(0)
    model = TinyGPT()
    opt = HybridAdam(model.parameters(), nvme_dir=str(tmp_path), **HP)
    for step in range(steps):
        _backward(model, step)
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = opt.state_dict()
    opt.close()
    return model, state


@pytest.mark.parametrize("placement", ["trace", "given"])
def test_a_disk_full_first_step_recovers_once_there_is_room(tmp_path, monkeypatch, one_thread,
                                                            placement):
    ref_model, ref_state = _reference(tmp_path, 2)
    backends = []  # one per store: a store shuts its backend down when it goes

    def make_backend(name, threads):
        backends.append(FaultBackend(write_errno=ENOSPC))  # the spill disk is full
        return backends[-1]

    monkeypatch.setattr(store_mod, "make_backend", make_backend)
    torch.manual_seed(0)
    model = TinyGPT()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "spilling ... failed" per chunk
        if placement == "given":  # the state is allocated at construction: it fails there
            with pytest.raises(TierFullError):
                HybridAdam(model.parameters(), nvme_dir=str(tmp_path), placement="given", **HP)
        opt = HybridAdam(model.parameters(), nvme_dir=str(tmp_path), **HP)
        _backward(model, 0)
        with pytest.raises(TierFullError):
            opt.step()
        with pytest.raises(TierFullError):
            opt.state_dict()  # still no room: refused the same way, nothing left half-made
    assert opt.store.keys() == []  # every key of the failed allocation was deleted
    for backend in backends:
        backend.write_errno = None  # space was freed
    opt.zero_grad(set_to_none=True)
    for step in range(2):  # the same steps as the reference, from the same weights
        _backward(model, step)
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = opt.state_dict()
    for (name, a), b in zip(ref_model.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    for i, st in ref_state["state"].items():
        for name, value in st.items():
            assert torch.equal(state["state"][i][name], value), (i, name)
    opt.close()
