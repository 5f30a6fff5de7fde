"""tiermem.checkpoint: the atomic writer, verified loading, clear errors, store snapshots."""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import pathlib
import random
import re
import stat

import numpy as np
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


# ------------------------------------------------------- what save writes, load reads (issue 27)
# Note [checkpoint payload types] (tiermem/_ckpt_payload.py): save refuses, before anything is
# replaced, every object load_checkpoint would refuse; the previous checkpoint stays loadable.

_NS = argparse.Namespace(lr=0.1, name="run")


def _refused_cases():
    return [  # (id, value, where the error points, the fix it names, the fixed value)
        ("namespace", _NS, r"extra\['x'\] is an argparse.Namespace", r"vars\(extra\['x'\]\)",
         vars(_NS)),
        ("np_float64", np.float64(1.25), r"extra\['x'\] is a numpy.float64",
         r"extra\['x'\].item\(\)", 1.25),
        ("np_int64", np.int64(7), r"extra\['x'\] is a numpy.int64", r"\.item\(\)", 7),
        ("np_float32_in_list", [1.0, np.float32(0.5)], r"extra\['x'\]\[1\] is a numpy.float32",
         r"\.item\(\)", [1.0, 0.5]),
        ("np_random_state", np.random.get_state(), r"extra\['x'\]\[1\] is a numpy.ndarray",
         r"torch.from_numpy\(extra\['x'\]\[1\]\)", None),
        ("path", pathlib.Path("/data/run1"), r"extra\['x'\] is a pathlib.PosixPath",
         r"str\(extra\['x'\]\)", "/data/run1"),
        ("datetime", datetime.datetime(2024, 6, 12, 10, 30), r"is a datetime.datetime",
         r"\.isoformat\(\)", "2024-06-12T10:30:00"),
        ("defaultdict", collections.defaultdict(list, a=[1]), r"is a collections.defaultdict",
         r"dict\(extra\['x'\]\)", {"a": [1]}),
        ("frozenset", frozenset({1, 2}), r"extra\['x'\] is a frozenset", r"set\(extra\['x'\]\)",
         {1, 2}),
        ("np_key", {np.int64(3): "a"}, r"extra\['x'\] has a key .*3.* of type numpy.int64",
         r"\.item\(\)", {3: "a"}),
        ("tensor_with_attr", _tensor_with_attr(), r"extra\['x'\] is a torch.Tensor",
         r"attributes", torch.ones(2)),
    ]


def _tensor_with_attr():
    t = torch.ones(2)
    t.scale = np.float64(2.0)  # saved with the tensor (its __dict__)
    return t


@pytest.mark.parametrize("case", _refused_cases(), ids=lambda c: c[0])
def test_save_refuses_what_load_would_refuse_and_keeps_the_previous_checkpoint(tmp_path, case):
    _, value, where, fix, fixed = case
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=_state(0), extra={"step": 1, "w": torch.arange(100.0)})
    before = path.read_bytes()
    with pytest.raises(TypeError, match=where) as info:
        save_checkpoint(path, model=_state(1), extra={"step": 2, "x": value})
    message = str(info.value)
    assert "\n" not in message and re.search(fix, message), message
    assert "load_checkpoint" in message and "fix:" in message
    assert path.read_bytes() == before  # untouched, bit for bit
    assert load_checkpoint(path)["extra"]["step"] == 1
    assert os.listdir(tmp_path) == ["c.pt"]  # no temporary directory left
    if fixed is not None:  # the fix the message names makes the save work
        save_checkpoint(path, extra={"step": 2, "x": fixed})
        got = load_checkpoint(path)["extra"]["x"]
        assert torch.equal(got, fixed) if isinstance(fixed, torch.Tensor) else got == fixed


def test_numpy_random_state_round_trips_through_the_named_fix(tmp_path):
    np.random.seed(3)
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    saved = (name, torch.from_numpy(keys.copy()), pos, has_gauss, gauss)
    save_checkpoint(tmp_path / "c.pt", extra={"np_rng": saved})
    expected = np.random.rand(5)
    np.random.seed(99)
    s = load_checkpoint(tmp_path / "c.pt")["extra"]["np_rng"]
    np.random.set_state((s[0], s[1].numpy(), s[2], s[3], s[4]))
    assert np.array_equal(np.random.rand(5), expected)


def test_optimizer_state_with_a_numpy_lr_is_refused_naming_the_param_group(tmp_path):
    model = _state(0)
    opt = torch.optim.SGD(model.parameters(), lr=np.float64(0.1))
    with pytest.raises(TypeError, match=r"optimizer.state_dict\(\)\['param_groups'\]\[0\]"
                                        r"\['lr'\] is a numpy.float64"):
        save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt)
    assert os.listdir(tmp_path) == []


def test_everything_load_reads_is_saved_without_complaint(tmp_path):
    extra = {"set": {1, "a"}, "od": collections.OrderedDict(b=2), "counter": collections.Counter(
        "aab"), "bytes": b"\x00\xff", "ba": bytearray(b"xy"), "complex": 1 + 2j,
        "size": torch.Size([2, 3]), "dtype": torch.bfloat16, "device": torch.device("cpu"),
        "param": torch.nn.Parameter(torch.ones(2)), "nested": [({"k": (None, True, -1.5)},)],
        3: "int key", ("a", 1): "tuple key", "big": 2 ** 70}
    save_checkpoint(tmp_path / "c.pt", extra=extra)
    got = load_checkpoint(tmp_path / "c.pt")["extra"]
    assert got.keys() == extra.keys()
    for k, v in extra.items():
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k
        assert type(got[k]) is type(v), k


def test_save_checks_the_written_file_with_the_loader_itself(tmp_path, monkeypatch):
    # the walk that names the key is one check; the loader itself reads the written file back
    # (lazily, through mmap) before the rename, so an object the walk misses is still refused
    import tiermem.checkpoint as ck  # noqa: PLC0415
    path = tmp_path / "c.pt"
    save_checkpoint(path, extra={"step": 1})
    before = path.read_bytes()
    monkeypatch.setattr(ck, "check_payload", lambda obj, label: None)
    with pytest.raises(TypeError, match=r"c.pt.*load_checkpoint would refuse.*numpy"):
        save_checkpoint(path, extra={"step": 2, "x": np.float64(1.0)})
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["c.pt"]


# ------------------------------------------------------------------- not a regular file (issue 27)


def _load_in_thread(load, path, **kwargs):
    """load(path, **kwargs) in a daemon thread; (finished, result or exception). The join's
    timeout only keeps a regression from hanging the suite: a fixed load returns at once."""
    import threading  # noqa: PLC0415
    out = {}

    def run():
        try:
            out["result"] = load(path, **kwargs)
        except BaseException as exc:  # noqa: BLE001  (reported to the test)
            out["result"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=60)
    return not t.is_alive(), out.get("result")


@pytest.mark.parametrize("what,verify", [("checkpoint", True), ("checkpoint", False),
                                         ("store", True)])
def test_loading_a_fifo_raises_at_once_naming_it(tmp_path, what, verify):
    fifo = tmp_path / "c.pt"
    os.mkfifo(fifo)
    store = small_store(tmp_path) if what == "store" else None
    load = load_checkpoint if store is None else lambda p, **k: load_store(p, store, **k)
    finished, result = _load_in_thread(load, fifo, verify=verify)
    if not finished:  # unblock the stuck reader so the thread ends
        with open(fifo, "wb"):
            pass
    assert finished, "load_checkpoint blocked on a FIFO"
    assert isinstance(result, CheckpointError), result
    assert str(fifo) in str(result) and "not a regular file" in str(result)
    assert "FIFO" in str(result) and "\n" not in str(result)
    if store is not None:
        assert len(store) == 0
        store.close()


def test_loading_a_directory_names_it(tmp_path):
    with pytest.raises(IsADirectoryError) as info:
        load_checkpoint(tmp_path)
    assert info.value.filename == str(tmp_path)
