"""tiermem.checkpoint in the corners users reach (reliability round three): a save that fails
over a good checkpoint (an exception, ENOSPC, a failing fsync or rename), a directory holding a
user's files, a load into a model or optimizer the checkpoint does not fit, a save while a
``param_sync="forward"`` step is still in flight, NVMe optimizer state that went bad."""

from __future__ import annotations

import copy
import errno
import glob
import os
import time

import pytest
import torch

import tiermem._ckpt_dir as ckpt_dir
import tiermem.checkpoint as ckpt
from models import TinyGPT
from tiermem.checkpoint import (CheckpointError, CheckpointMismatch, load_checkpoint,
                                save_checkpoint)
from tiermem.optim import HybridAdam
from tiermem.optim.chunk_worker import ChunkWorker
from tiermem.store.nvme import SpillCorruption

USER_FILES = {"notes.txt": b"mine", "data": b"a user's file named like the temp file",
              ".tiermem-owner": b"a user's file named like the marker", "c.pt.bak": b"old"}


def _two_layer(out=3, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, out))


def _trained(out=3, seed=0):
    model = _two_layer(out, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _snapshot(model, opt=None):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if opt is not None:
        state["opt"] = copy.deepcopy(opt.state_dict())
    return state


def _assert_same(model, opt, snap):
    for k, v in model.state_dict().items():
        assert torch.equal(v, snap[k]), f"{k} changed by a refused load"
    if opt is not None:
        now = opt.state_dict()
        assert now["param_groups"] == snap["opt"]["param_groups"]
        assert now["state"].keys() == snap["opt"]["state"].keys()
        for i, st in now["state"].items():
            for name, value in st.items():
                assert torch.equal(value, snap["opt"]["state"][i][name]), (i, name)


def _one_step(model, opt):
    torch.manual_seed(5)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


# ------------------------------------------------------------------ loads that do not fit


def test_a_model_with_other_shapes_is_refused_before_any_weight_is_copied(tmp_path):
    """torch's load_state_dict copies every parameter that fits before it raises about the one
    that does not: the model was left half loaded (the first layer from the checkpoint)."""
    model, opt = _trained(out=3)
    save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt)
    other, other_opt = _trained(out=5, seed=1)
    snap = _snapshot(other, other_opt)
    twin = copy.deepcopy(other)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    twin_opt.load_state_dict(copy.deepcopy(other_opt.state_dict()))  # (it keeps the tensors)
    with pytest.raises(CheckpointMismatch, match=r"size mismatch.*'1\.weight' has shape "
                       r"\(3, 4\) in the checkpoint but \(5, 4\) in the model.*nothing was "
                       r"loaded") as info:
        load_checkpoint(tmp_path / "c.pt", model=other, optimizer=other_opt)
    assert "\n" not in str(info.value) and info.value.path == str(tmp_path / "c.pt")
    assert isinstance(info.value, RuntimeError)  # what torch's own error was
    _assert_same(other, other_opt, snap)
    # still usable: the next step is the one a copy that never saw the load takes
    assert all(torch.equal(a, b) for a, b in zip(_one_step(other, other_opt),
                                                  _one_step(twin, twin_opt)))


@pytest.mark.parametrize("case", ["unexpected", "missing"])
def test_strict_key_mismatch_is_refused_before_any_weight_is_copied(tmp_path, case):
    """torch's strict load copies every key it knows and then raises about the unexpected or
    missing ones: the model was left fully overwritten by a checkpoint of another model."""
    torch.manual_seed(0)
    saved = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    save_checkpoint(tmp_path / "c.pt", model=saved)
    torch.manual_seed(1)
    layers = 1 if case == "unexpected" else 3
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])
    snap = _snapshot(model)
    word = "unexpected keys: '1.weight', '1.bias'" if case == "unexpected" else \
        "missing keys: '2.weight', '2.bias'"
    with pytest.raises(CheckpointMismatch, match=f"{word}.*nothing was loaded.*strict=False"):
        load_checkpoint(tmp_path / "c.pt", model=model)
    _assert_same(model, None, snap)
    load_checkpoint(tmp_path / "c.pt", model=model, strict=False)  # torch's meaning of it
    assert torch.equal(model[0].weight, saved[0].weight)


def test_an_optimizer_that_does_not_fit_is_refused_before_the_model_is_touched(tmp_path):
    """The model fitted and was loaded; then the optimizer refused the state (other param
    groups): the model held the checkpoint's weights, the optimizer its old state."""
    model, opt = _trained()
    save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt)
    other, _ = _trained(seed=1)
    params = list(other.parameters())
    other_opt = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
    snap = _snapshot(other, other_opt)
    with pytest.raises(CheckpointMismatch, match="1 param groups in the checkpoint but 2 in the "
                       "optimizer.*nothing was loaded"):
        load_checkpoint(tmp_path / "c.pt", model=other, optimizer=other_opt)
    _assert_same(other, other_opt, snap)


def test_optimizer_state_of_other_shapes_is_refused_and_the_old_state_kept(tmp_path):
    """AdamW's load_state_dict takes exp_avg tensors of any shape: the optimizer's state was
    replaced and the next step failed (or broadcast), with the previous state gone."""
    model, opt = _trained()
    save_checkpoint(tmp_path / "c.pt", optimizer=opt)
    other, other_opt = _trained(seed=1)
    params = list(other.parameters())  # same count, other order: the shapes do not match
    other_opt = torch.optim.AdamW([params[2], params[3], params[0], params[1]], lr=1e-2)
    _one_step(other, other_opt)
    snap = _snapshot(other, other_opt)
    with pytest.raises(CheckpointMismatch, match=r"exp_avg of param 0 \(group 0\) has shape "
                       r"\(4, 4\) but the param has \(3, 4\); the state is for another model"):
        load_checkpoint(tmp_path / "c.pt", optimizer=other_opt)
    _assert_same(other, other_opt, snap)
    _one_step(other, other_opt)  # still steps


def test_a_hybrid_adam_over_other_params_is_refused_before_the_model_is_touched(tmp_path):
    """HybridAdam checks the state before it loads anything, but load_checkpoint loaded the
    model first: the model held the checkpoint's weights when HybridAdam refused."""
    torch.manual_seed(0)
    model = TinyGPT(n_layers=1)
    opt = HybridAdam(model.parameters(), lr=1e-3, offload_fraction=0.5, chunk_numel=1024)
    save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt)
    opt.close()
    torch.manual_seed(1)
    other = TinyGPT(n_layers=1)
    other_opt = HybridAdam(list(other.parameters())[1:], lr=1e-3, offload_fraction=0.5,
                           chunk_numel=1024)
    snap = _snapshot(other)
    with pytest.raises(CheckpointMismatch, match="has .* params in the checkpoint but .* in "
                       "the optimizer"):
        load_checkpoint(tmp_path / "c.pt", model=other, optimizer=other_opt)
    _assert_same(other, None, snap)
    other_opt.close()


def test_a_state_only_hybrid_adam_refuses_is_refused_before_the_model_is_touched(tmp_path):
    """An AdamW(amsgrad=True) run resumed with HybridAdam: the model and the param groups fit,
    HybridAdam refuses the amsgrad state, and load_checkpoint asks it first
    (``HybridAdam.check_state_dict``), so the model is untouched; it used to be loaded."""
    torch.manual_seed(0)
    model = TinyGPT(n_layers=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, amsgrad=True)
    model(*next(_batches()))[1].backward()
    opt.step()
    save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt)
    torch.manual_seed(1)
    other = TinyGPT(n_layers=1)
    other_opt = HybridAdam(other.parameters(), lr=1e-3, offload_fraction=0.5, chunk_numel=1024)
    snap = _snapshot(other)
    try:
        with pytest.raises(CheckpointMismatch, match=r"amsgrad.*nothing was loaded"):
            load_checkpoint(tmp_path / "c.pt", model=other, optimizer=other_opt)
        _assert_same(other, None, snap)
    finally:
        other_opt.close()


def test_a_checkpoint_that_fits_still_loads_exactly(tmp_path):
    """The twin of the refusals above: the checks pass a matching model and optimizer (a
    0-dim param, a buffer, a second param group) and the load is exact."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model.register_parameter("scale", torch.nn.Parameter(torch.tensor(2.0)))
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 0.1}])
    (model(torch.randn(3, 4)) * model.scale).sum().backward()
    opt.step()
    save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt)
    torch.manual_seed(1)
    other = copy.deepcopy(model)
    for p in other.parameters():
        p.data.normal_()
    params = list(other.parameters())
    other_opt = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}])
    load_checkpoint(tmp_path / "c.pt", model=other, optimizer=other_opt)
    _assert_same(other, other_opt, _snapshot(model, opt))


# ------------------------------------------------------------------ saves that fail


def _good_checkpoint(tmp_path):
    """A directory with a user's files and a good checkpoint; returns (path, its bytes)."""
    for name, data in USER_FILES.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "runs").mkdir()
    path = tmp_path / "c.pt"
    save_checkpoint(path, extra={"step": 1, "w": torch.arange(1000.0)})
    return path, path.read_bytes()


def _assert_kept(tmp_path, path, good):
    assert path.read_bytes() == good, "the good checkpoint changed"
    assert load_checkpoint(path)["extra"]["step"] == 1
    assert sorted(os.listdir(tmp_path)) == sorted([*USER_FILES, "runs", "c.pt"])
    for name, data in USER_FILES.items():
        assert (tmp_path / name).read_bytes() == data, name


class _FullFile:
    """A file whose writes raise ENOSPC once ``room`` bytes were written (``None``: at the
    write of the integrity trailer, after the whole payload)."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, data):
        n = memoryview(data).nbytes
        if self.room is None and bytes(memoryview(data)[:len(ckpt._MAGIC)]) == ckpt._MAGIC:
            raise OSError(errno.ENOSPC, "No space left on device")
        if self.room is not None and n > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room = None if self.room is None else self.room - n
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)


def _fail_nth(monkeypatch, owner, name, exc, nth=1):
    """Make the ``nth`` call of ``owner.name`` (and later ones) raise ``exc``."""
    real = getattr(owner, name)
    calls = [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] >= nth:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)


def _fail_open_of(monkeypatch, name, exc):
    """Make ``os.open`` of ``name`` relative to a directory descriptor raise ``exc``."""
    real = os.open

    def failing(path, *args, **kwargs):
        if path == name and kwargs.get("dir_fd") is not None:
            raise exc
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", failing)


def _full_disk_after(monkeypatch, room):
    real = os.fdopen
    calls = [0]

    def fdopen(*args, **kwargs):  # the marker's file is the first, the checkpoint's the second
        calls[0] += 1
        f = real(*args, **kwargs)
        return _FullFile(f, room) if calls[0] == 2 else f

    monkeypatch.setattr(os, "fdopen", fdopen)


EIO = OSError(errno.EIO, "Input/output error")
ENOSPC = OSError(errno.ENOSPC, "No space left on device")
FAILURES = {
    "torch.save raises": lambda mp: _fail_nth(mp, torch, "save", RuntimeError("boom")),
    "disk full at byte 0": lambda mp: _full_disk_after(mp, 0),
    "disk full mid-payload": lambda mp: _full_disk_after(mp, 3000),
    "disk full at the trailer": lambda mp: _full_disk_after(mp, None),
    "fsync fails": lambda mp: _fail_nth(mp, os, "fsync", EIO),
    "read-back interrupted": lambda mp: _fail_nth(mp, ckpt, "_check_readable",
                                                  KeyboardInterrupt()),
    "rename fails": lambda mp: _fail_nth(mp, os, "replace", EIO),
    "rename interrupted": lambda mp: _fail_nth(mp, os, "replace", KeyboardInterrupt()),
    "disk full at mkdir": lambda mp: _fail_nth(mp, os, "mkdir", ENOSPC),
    "disk full at the marker": lambda mp: _fail_nth(mp, ckpt_dir, "write_marker", ENOSPC),
    "no inode for the file": lambda mp: _fail_open_of(mp, "data", ENOSPC),
}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_failed_save_keeps_the_good_checkpoint_and_only_removes_its_own_files(
        tmp_path, monkeypatch, failure):
    """Each failure point of a save over a good checkpoint, in a directory holding a user's
    files (some named like tiermem's own): the old checkpoint stays byte-identical and loads,
    the save's temporary directory is gone, the user's files are untouched, and an OSError is
    one line naming the checkpoint (it named only the temporary directory's basename, or
    nothing, when mkdir, the marker or the file's creation failed)."""
    path, good = _good_checkpoint(tmp_path)
    FAILURES[failure](monkeypatch)
    with pytest.raises(BaseException) as info:
        save_checkpoint(path, extra={"step": 2, "w": torch.arange(2000.0)})
    monkeypatch.undo()
    _assert_kept(tmp_path, path, good)
    if isinstance(info.value, OSError):
        text = str(info.value)
        assert str(path) in text and "\n" not in text, text
        assert info.value.errno in (errno.ENOSPC, errno.EIO)
    save_checkpoint(path, extra={"step": 3})  # the next save works
    assert load_checkpoint(path)["extra"] == {"step": 3}


def test_a_failed_directory_fsync_after_the_rename_says_the_new_checkpoint_is_in_place(
        tmp_path, monkeypatch):
    """The rename has happened when the directory's fsync fails: the error said only
    "[Errno 5] Input/output error", leaving the user to guess which checkpoint they have."""
    path, _ = _good_checkpoint(tmp_path)
    monkeypatch.setattr(ckpt, "_fsync_dir", lambda fd: (_ for _ in ()).throw(EIO))
    with pytest.raises(OSError, match=r"checkpoint .*c\.pt was written and renamed into place, "
                       r"but the fsync of its directory failed") as info:
        save_checkpoint(path, extra={"step": 2})
    assert info.value.errno == errno.EIO and "\n" not in str(info.value)
    monkeypatch.undo()
    assert load_checkpoint(path)["extra"] == {"step": 2}
    assert sorted(os.listdir(tmp_path)) == sorted([*USER_FILES, "runs", "c.pt"])


def test_saving_where_a_file_or_directory_is_in_the_way_changes_nothing(tmp_path):
    path, good = _good_checkpoint(tmp_path)
    with pytest.raises(NotADirectoryError) as info:
        save_checkpoint(tmp_path / "notes.txt" / "c.pt", extra=1)
    assert info.value.filename == str(tmp_path / "notes.txt")
    with pytest.raises(IsADirectoryError):
        save_checkpoint(tmp_path / "runs", extra=1)
    _assert_kept(tmp_path, path, good)
    assert os.listdir(tmp_path / "runs") == []


def test_a_users_file_at_the_checkpoint_path_is_not_replaced(tmp_path):
    """A save to a path holding a file tiermem did not write (a typo, a plain torch.save
    file) replaced it: the user's file was gone. Now refused in one line naming it; a
    tiermem checkpoint or store snapshot, an empty file and a symlink are still replaced."""
    path, good = _good_checkpoint(tmp_path)
    torch.save({"w": torch.ones(3)}, tmp_path / "plain.pt")
    plain = (tmp_path / "plain.pt").read_bytes()
    for name in ("notes.txt", "plain.pt"):
        with pytest.raises(FileExistsError, match="is not a tiermem checkpoint.*refusing to "
                           "replace a file tiermem did not write; fix: ") as info:
            save_checkpoint(tmp_path / name, extra={"step": 2})
        assert info.value.filename == str(tmp_path / name) and "\n" not in str(info.value)
    assert (tmp_path / "notes.txt").read_bytes() == USER_FILES["notes.txt"]
    assert (tmp_path / "plain.pt").read_bytes() == plain
    (tmp_path / "plain.pt").unlink()
    _assert_kept(tmp_path, path, good)
    (tmp_path / "empty.pt").touch()
    save_checkpoint(tmp_path / "empty.pt", extra={"step": 2})
    ckpt.atomic_save({"x": 1}, path)  # a file of atomic_save, any payload
    save_checkpoint(path, extra={"step": 3})
    assert load_checkpoint(path)["extra"] == {"step": 3}
    assert load_checkpoint(tmp_path / "empty.pt")["extra"] == {"step": 2}


def test_two_saves_in_a_row_leave_the_second_and_nothing_else(tmp_path):
    path, _ = _good_checkpoint(tmp_path)
    save_checkpoint(path, extra={"step": 2})
    save_checkpoint(path, extra={"step": 3})
    assert load_checkpoint(path)["extra"] == {"step": 3}
    assert sorted(os.listdir(tmp_path)) == sorted([*USER_FILES, "runs", "c.pt"])


# ------------------------------------------------------------------ HybridAdam's state


def _gpt_and_hybrid(tmp_path, **kw):
    torch.manual_seed(0)
    model = TinyGPT()
    opt = HybridAdam(model.parameters(), lr=1e-2, offload_fraction=1.0, chunk_numel=1024, **kw)
    return model, opt


def _batches(seed=0):
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield (torch.randint(0, 64, (2, 8), generator=gen),
               torch.randint(0, 64, (2, 8), generator=gen))


def _train(model, opt, batches, steps):
    for _ in range(steps):
        model(*next(batches))[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("damage", ["bit flip", "truncation"])
def test_a_save_of_nvme_state_that_went_bad_is_refused_and_the_good_checkpoint_kept(
        tmp_path, damage):
    """HybridAdam's state on the NVMe tier is read back through its CRC-32C: a damaged spill
    file makes the save raise SpillCorruption (naming the file) instead of writing garbage
    over the last good checkpoint."""
    model, opt = _gpt_and_hybrid(tmp_path, state_tier="nvme", nvme_dir=str(tmp_path))
    batches = _batches()
    _train(model, opt, batches, 2)
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=model, optimizer=opt, extra={"step": 2})
    good = path.read_bytes()
    _train(model, opt, batches, 1)
    (spill,) = glob.glob(str(tmp_path / "tiermem-*" / "spill.bin"))
    with open(spill, "r+b") as f:
        if damage == "truncation":
            f.truncate(50)
        else:
            f.seek(100)
            byte = f.read(1)[0]
            f.seek(100)
            f.write(bytes([byte ^ 1]))
    with pytest.raises(SpillCorruption, match=spill):
        save_checkpoint(path, model=model, optimizer=opt, extra={"step": 3})
    assert path.read_bytes() == good
    assert load_checkpoint(path)["extra"]["step"] == 2
    assert not [n for n in os.listdir(tmp_path) if ".tiermem-tmp-" in n]
    opt.close()


def test_a_resumed_run_whose_nvme_state_went_bad_never_steps_or_saves_from_it(tmp_path):
    """Resumed into HybridAdam with its state on NVMe, then a bit of the spill file flips: the
    step raises naming the spill file (never steps that chunk from garbage), and the save
    after it raises too, so the last good checkpoint stays the one to resume from."""
    model, opt = _gpt_and_hybrid(tmp_path, state_tier="nvme", nvme_dir=str(tmp_path))
    batches = _batches()
    _train(model, opt, batches, 2)
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=model, optimizer=opt, extra={"step": 2})
    good = path.read_bytes()
    opt.close()
    torch.manual_seed(1)
    model = TinyGPT()
    opt = HybridAdam(model.parameters(), lr=1e-2, offload_fraction=1.0, chunk_numel=1024,
                     state_tier="nvme", nvme_dir=str(tmp_path))
    load_checkpoint(path, model=model, optimizer=opt)
    (spill,) = glob.glob(str(tmp_path / "tiermem-*" / "spill.bin"))
    with open(spill, "r+b") as f:
        f.seek(5000)
        byte = f.read(1)[0]
        f.seek(5000)
        f.write(bytes([byte ^ 0x10]))
    with pytest.raises(RuntimeError, match=f"CRC32C mismatch.*{spill}"):
        _train(model, opt, batches, 1)
        opt.synchronize()
    # Note [failed steps]: a step failed partway, so the save refuses the mixed state
    with pytest.raises(RuntimeError, match=rf"state_dict\(\) refused.*{spill}"):
        save_checkpoint(path, model=model, optimizer=opt, extra={"step": 3})
    assert path.read_bytes() == good
    opt.close()


def _slow_worker(monkeypatch, seconds=0.01):
    """The CPU side of a step takes ``seconds`` per chunk (the step stays in flight)."""
    real = ChunkWorker._step_chunk

    def slow(self, *args):
        time.sleep(seconds)
        return real(self, *args)

    monkeypatch.setattr(ChunkWorker, "_step_chunk", slow)


def test_a_save_during_an_in_flight_step_holds_one_step(tmp_path, monkeypatch):
    """``param_sync="forward"``: ``step()`` returns while the worker still writes the params.
    save_checkpoint took ``model.state_dict()`` before ``optimizer.state_dict()`` (which
    completes the step): a model whose state dict is a copy (a state-dict hook, as a
    quantizing or weight-tying wrapper has) was saved with a mix of the step before's and this
    step's weights. Two saves in a row during two in-flight steps each hold their step."""
    model, opt = _gpt_and_hybrid(tmp_path, param_sync="forward")
    model.register_state_dict_post_hook(
        lambda module, state, prefix, meta: state.update({k: v.clone() for k, v in
                                                          state.items()}))
    batches = _batches()
    _train(model, opt, batches, 2)  # the first step records the gradient order (no overlap)
    opt.synchronize()
    _slow_worker(monkeypatch)
    for step in (3, 4):
        _train(model, opt, batches, 1)
        assert opt._pending, "the step is not in flight: the test tests nothing"
        save_checkpoint(tmp_path / f"c{step}.pt", model=model, optimizer=opt)
        want = {k: v.clone() for k, v in model.state_dict().items()}
        saved = load_checkpoint(tmp_path / f"c{step}.pt")
        torn = [k for k, v in saved["model"].items() if not torch.equal(v, want[k])]
        assert not torn, f"step {step}: saved weights of another step: {torn[:4]}"
        assert all(float(st["step"]) == step for st in saved["optimizer"]["state"].values())
    opt.close()


def test_a_model_only_save_during_an_in_flight_step_holds_one_step(tmp_path, monkeypatch):
    """``save_checkpoint(path, model=model)`` right after a ``param_sync="forward"`` step saved
    the parameters while the worker was still writing them: a mix of two steps, loaded without
    complaint. The model's state-dict pre-hooks complete the pending step first
    (Note [model state dicts after a forward-synced step] in tiermem/optim/forward_sync.py)."""
    model, opt = _gpt_and_hybrid(tmp_path, param_sync="forward")
    batches = _batches()
    _train(model, opt, batches, 2)
    opt.synchronize()
    _slow_worker(monkeypatch)
    _train(model, opt, batches, 1)
    assert opt._pending
    try:
        save_checkpoint(tmp_path / "c.pt", model=model)
        opt.synchronize()
        saved = load_checkpoint(tmp_path / "c.pt")["model"]
        torn = [k for k, v in model.state_dict().items() if not torch.equal(v, saved[k])]
        assert not torn, f"saved weights of two steps: {torn[:4]}"
    finally:
        opt.close()


def test_checkpoint_errors_keep_their_base_classes():
    """Callers catching torch's own errors (RuntimeError for a model, ValueError for an
    optimizer) still catch a mismatch refused before either was touched."""
    assert issubclass(CheckpointMismatch, CheckpointError)
    assert issubclass(CheckpointMismatch, RuntimeError)
    assert issubclass(CheckpointMismatch, ValueError)
