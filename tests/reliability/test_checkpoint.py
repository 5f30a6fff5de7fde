"""tiermem.checkpoint: the atomic writer, verified loading, clear errors, store snapshots."""

from __future__ import annotations

import os
import random
import stat

import pytest
import torch

from _faults import FaultBackend, install_backend, rand, small_store
from models import TinyGPT
from tiermem import TierFullError
from tiermem.checkpoint import (CheckpointCorruption, CheckpointError, load_checkpoint, load_store,
                                save_checkpoint, save_store)
from tiermem.optim import HybridAdam
from tiermem.store.nvme import SpillError


def _state(seed=0):
    torch.manual_seed(seed)
    return TinyGPT(n_layers=1)


def test_round_trip_with_model_optimizer_and_extra(tmp_path):
    model = _state(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 4, dtype=torch.long))[0].sum().backward()
    opt.step()
    extra = {"step": 7, "losses": [1.5, 1.25], "rng": torch.get_rng_state(), "tag": ("a", 1),
             "none": None, "flag": True}
    save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, extra=extra)
    model2 = _state(1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    payload = load_checkpoint(tmp_path / "c.pt", model=model2, optimizer=opt2)
    assert payload["extra"]["losses"] == [1.5, 1.25] and payload["extra"]["tag"] == ("a", 1)
    assert torch.equal(payload["extra"]["rng"], extra["rng"])
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert opt2.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    mode = stat.S_IMODE(os.stat(tmp_path / "c.pt").st_mode)
    assert mode == 0o600
    assert os.listdir(tmp_path) == ["c.pt"]


def test_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint") as info:
        load_checkpoint(tmp_path / "nope.pt")
    assert info.value.filename == str(tmp_path / "nope.pt")
    with pytest.raises(FileNotFoundError, match="directory does not exist"):
        save_checkpoint(tmp_path / "no" / "dir.pt", extra=1)


@pytest.mark.parametrize("keep", [0, 10, 0.5, -1, -48, -49])
def test_truncated_file_is_refused_naming_it(tmp_path, keep):
    path = tmp_path / "c.pt"
    save_checkpoint(path, extra={"w": torch.arange(10000.0)})
    data = path.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else keep % len(data) if keep else 0
    path.write_bytes(data[:n])
    model = _state(0)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(CheckpointCorruption, match="truncated|damaged") as info:
        load_checkpoint(path, model=model)
    assert str(path) in str(info.value) and info.value.path == str(path)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # untouched


def test_any_flipped_bit_is_detected(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=_state(0), extra={"w": torch.arange(5000.0)})
    data = path.read_bytes()
    rng = random.Random(0)
    for _ in range(40):  # torch.load alone returns wrong numbers for most of these
        bad = bytearray(data)
        i = rng.randrange(len(bad))
        bad[i] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(bad))
        with pytest.raises(CheckpointCorruption, match=r"corrupted|damaged|truncated") as info:
            load_checkpoint(path)
        assert str(path) in str(info.value)
    path.write_bytes(data)
    load_checkpoint(path)


def test_wrong_model_or_optimizer_raise_their_own_errors(tmp_path):
    model = TinyGPT()
    opt = HybridAdam(model.parameters(), offload_fraction=0.5, chunk_numel=1024)
    save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt)
    opt.close()
    other = TinyGPT(d_model=16)
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_checkpoint(tmp_path / "c.pt", model=other)
    other_opt = HybridAdam(other.parameters(), offload_fraction=0.5, chunk_numel=1024)
    with pytest.raises(ValueError, match="the state is for another model"):
        load_checkpoint(tmp_path / "c.pt", optimizer=other_opt)
    other_opt.close()
    save_checkpoint(tmp_path / "m.pt", model=model)
    with pytest.raises(CheckpointError, match="has no optimizer state"):
        load_checkpoint(tmp_path / "m.pt", model=TinyGPT(), optimizer=torch.optim.SGD(
            TinyGPT().parameters(), lr=0.1))


def test_not_a_checkpoint(tmp_path):
    torch.save({"model": {}}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointCorruption, match="not written by tiermem.checkpoint"):
        load_checkpoint(tmp_path / "plain.pt")
    store = small_store(tmp_path)
    save_store(store, tmp_path / "store.snap")
    with pytest.raises(CheckpointError, match="is not a tiermem.checkpoint file"):
        load_checkpoint(tmp_path / "store.snap")
    save_checkpoint(tmp_path / "c.pt", extra=1)
    with pytest.raises(CheckpointError, match="is not a tiermem.store file"):
        load_store(tmp_path / "c.pt", store)
    store.close()
    with pytest.raises(TypeError, match="nn.Module"):
        save_checkpoint(tmp_path / "x.pt", model={"w": 1})


# ------------------------------------------------------------------------------ store snapshots


def _fill(store):
    values = {
        "cpu_f32": (rand(1000, seed=1), "cpu"),
        ("layer", 3, "bf16"): (rand(777, seed=2, dtype=torch.bfloat16), "nvme"),
        7: (torch.arange(24, dtype=torch.int64).reshape(2, 3, 4), "gpu"),
        ("empty",): (torch.empty(0, 5), "cpu"),
        ("nested", ("a", 1)): (rand(3000, seed=3).reshape(30, 100).t(), "nvme"),  # non-contig.
    }
    for key, (t, tier) in values.items():
        store.put(key, t, tier=tier)
    store.synchronize()
    return values


def test_store_snapshot_round_trip_keeps_tiers_dtypes_and_shapes(tmp_path):
    src = small_store(tmp_path)
    values = _fill(src)
    tiers = save_store(src, tmp_path / "s.snap")
    assert tiers == {k: t for k, (_, t) in values.items()}
    assert {k: src.tier_of(k) for k in values} == tiers  # saving moved nothing
    dst = small_store(tmp_path)
    placed = load_store(tmp_path / "s.snap", dst)
    assert placed == tiers
    for key, (t, tier) in values.items():
        got = dst.get(key, "cpu")
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), key
    src.close()
    dst.close()


def test_store_snapshot_into_smaller_store_places_keys_elsewhere(tmp_path):
    src = small_store(tmp_path)
    values = _fill(src)
    save_store(src, tmp_path / "s.snap")
    dst = small_store(tmp_path, gpu_bytes=0, nvme_bytes=0, cpu_bytes=64 << 10)
    placed = load_store(tmp_path / "s.snap", dst)
    assert set(placed.values()) == {"cpu"}
    for key, (t, _) in values.items():
        assert torch.equal(dst.get(key, "cpu"), t)
    tiny = small_store(tmp_path, gpu_bytes=0, nvme_bytes=0, cpu_bytes=8 << 10)
    with pytest.raises(TierFullError, match="fit in no tier"):
        load_store(tmp_path / "s.snap", tiny)
    for s in (src, dst, tiny):
        s.close()


def test_store_snapshot_rejects_unsaveable_keys_before_writing(tmp_path):
    store = small_store(tmp_path)
    store.put("ok", torch.ones(3))
    store.put(1.5, torch.ones(3))
    with pytest.raises(TypeError, match="key 1.5 cannot be saved"):
        save_store(store, tmp_path / "s.snap")
    assert not os.path.exists(tmp_path / "s.snap")
    store.close()


def test_store_snapshot_read_error_keeps_previous_file(tmp_path, monkeypatch):
    backend = FaultBackend()
    install_backend(monkeypatch, backend)
    store = small_store(tmp_path)
    store.put("k", rand(1000), tier="nvme")
    store.synchronize()
    save_store(store, tmp_path / "s.snap")
    backend.read_errno = 5  # EIO from now on
    with pytest.raises(SpillError, match="Input/output error"):
        save_store(store, tmp_path / "s.snap")
    assert [n for n in os.listdir(tmp_path) if "tmp" in n] == []  # nothing half-written
    backend.read_errno = None
    dst = small_store(tmp_path)
    load_store(tmp_path / "s.snap", dst)
    assert torch.equal(dst.get("k", "cpu"), rand(1000))
    for s in (store, dst):
        s.close()
    backend.shutdown()
